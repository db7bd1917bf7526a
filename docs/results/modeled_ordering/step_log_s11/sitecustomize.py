"""Session 11 step log: every engine step of a live modeled worker, one JSON line each.

Put this folder first on PYTHONPATH and set CPD_STEP_LOG_DIR; a worker process
(``python -m cpd.worker.main ... --worker-id ID``) then writes ``$CPD_STEP_LOG_DIR/ID-<pid>.jsonl``
with, per ``Engine.step``: ``t0`` / ``t1`` (time.monotonic at the call and its return, wall s),
``tok`` (tokens the step computed: the engine's ``step_tokens_total`` difference), ``busy`` (the
modeled executor's undilated modeled seconds waited in the step: forward and loads), ``out``
(outputs), and at the return ``wait`` / ``run`` (requests waiting / running in the engine).
The gaps between one step's ``t1`` and the next ``t0`` are the worker's time outside the engine's
steps (handoff staging, event publishing, delivery, the HTTP side holding the GIL). No cpd code is
changed; other processes (router, benchmark) are left alone. Used by
docs/results/modeled_ordering/README.md, section "Session 11 rerun".
"""
import json
import os
import time


def _install() -> None:
    d = os.environ.get("CPD_STEP_LOG_DIR")
    if not d:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return
    if b"cpd.worker.main" not in argv or b"--worker-id" not in argv:
        return
    wid = argv[argv.index(b"--worker-id") + 1].decode()
    import cpd.engine.engine as eng

    out = open(os.path.join(d, f"{wid}-{os.getpid()}.jsonl"), "a", buffering=1)
    orig = eng.Engine.step

    def step(self):
        t0 = time.monotonic()
        tok0 = self.step_tokens_total
        ex = getattr(self, "executor", None)
        b0 = getattr(ex, "busy_s", 0.0)
        res = orig(self)
        t1 = time.monotonic()
        if self.step_tokens_total != tok0 or res:
            out.write(json.dumps({"t0": round(t0, 5), "t1": round(t1, 5), "tok": self.step_tokens_total - tok0,
                                  "busy": round(getattr(ex, "busy_s", 0.0) - b0, 5), "out": len(res),
                                  "wait": len(self._waiting), "run": len(self._running)}) + "\n")
        return res

    eng.Engine.step = step


_install()
