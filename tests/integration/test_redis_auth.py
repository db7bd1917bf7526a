"""L3 store URLs with credentials and TLS against real redis-server processes (issue 12 §3):
``requirepass`` (``redis://:PASS@``), an ACL user (``redis://USER:PASS@``) and TLS
(``rediss://...?ssl_ca_certs=``, certificates made here with openssl). Wrong credentials and a
plain client against the TLS port make the store unavailable (a miss), never a wrong read."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from urllib.parse import quote, urlsplit

import numpy as np
import pytest

from cpd.store import StoreUnavailable, open_store
from cpd.store.redis_url import connection_kwargs
from conftest import free_port

PASSWORD = "p@ss:w/rd"  # characters that need escaping in a URL


def _wait_port(port: int) -> None:
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@pytest.fixture
def redis_proc(tmp_path):
    procs = []

    def start(*args: str) -> int:
        port = free_port()
        exe = shutil.which("redis-server") or pytest.fail("redis-server not installed")
        tls = "--tls-port" in args
        port_args = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
        args = tuple(a for a in args if a != "--tls-port")
        p = subprocess.Popen([exe, *port_args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--dir", str(tmp_path), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        _wait_port(port)
        return port
    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def test_url_parsing_user_password_tls():
    u = urlsplit(f"rediss://alice:{quote(PASSWORD, safe='')}@h:7000/0")
    kw = connection_kwargs(u, {"ssl_ca_certs": "/ca.pem"})
    assert kw["username"] == "alice" and kw["password"] == PASSWORD
    assert kw["ssl"] is True and kw["ssl_ca_certs"] == "/ca.pem" and kw["ssl_cert_reqs"] == "required"
    assert connection_kwargs(urlsplit("redis://:pw@h:1"), {}) == {"password": "pw"}
    assert connection_kwargs(urlsplit("redis://h:1"), {}) == {}
    with pytest.raises(ValueError):
        connection_kwargs(urlsplit("rediss://h:1"), {"ssl_cert_reqs": "maybe"})


def _store_works(url: str) -> bool:
    """Write one block and read it back through a store opened from ``url``."""
    store = open_store(url, chunk_blocks=1)
    block = np.arange(64, dtype=np.float32).reshape(2, 32)
    try:
        store.put_blocks([12345], [block])
        got = store.get_blocks([12345])
        assert got is not None and np.array_equal(got[0], block)
        return True
    except StoreUnavailable:
        return False
    finally:
        close = getattr(store, "close", None)
        if close:
            close()


def test_requirepass_and_acl_user(redis_proc):
    port = redis_proc("--requirepass", PASSWORD)
    pw = quote(PASSWORD, safe="")
    assert _store_works(f"redis://:{pw}@127.0.0.1:{port}")
    assert not _store_works(f"redis://:wrong@127.0.0.1:{port}")
    assert not _store_works(f"redis://127.0.0.1:{port}")
    import redis
    admin = redis.Redis(port=port, password=PASSWORD)
    admin.acl_setuser("cpd", enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], channels=["*"],
                      commands=["+@all"])
    port2 = port
    assert _store_works(f"redis://cpd:{pw}@127.0.0.1:{port2}")
    assert not _store_works(f"redis://cpd:nope@127.0.0.1:{port2}")
    assert "wrong" not in open_store(f"redis://:wrong@127.0.0.1:{port}").url  # no password in logs


def _make_certs(d) -> dict:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed: cannot make TLS certificates")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=cpd-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key", "-out", "srv.csr")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "ext", "-out", "srv.pem")
    return {k: str(d / f) for k, f in (("ca", "ca.pem"), ("cert", "srv.pem"), ("key", "srv.key"))}


def test_tls_rediss(redis_proc, tmp_path):
    c = _make_certs(tmp_path)
    port = redis_proc("--tls-port", "--tls-cert-file", c["cert"], "--tls-key-file", c["key"],
                      "--tls-ca-cert-file", c["ca"], "--tls-auth-clients", "no", "--requirepass", "pw")
    assert _store_works(f"rediss://:pw@127.0.0.1:{port}?ssl_ca_certs={c['ca']}")
    assert not _store_works(f"redis://:pw@127.0.0.1:{port}")  # plain text against the TLS port
    assert not _store_works(f"rediss://:pw@127.0.0.1:{port}")  # server certificate not trusted (system CAs)
    assert open_store(f"rediss://:pw@127.0.0.1:{port}?ssl_ca_certs={c['ca']}").url.startswith("rediss://")
