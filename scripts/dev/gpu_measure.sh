#!/usr/bin/env bash
# The open GPU measurements, by part, each under its own time limit, so that one device call
# of at most 10 minutes takes as many as fit; each part's log goes to $OUT/<part>.txt and its
# tail is printed as it ends. Run from the checkout root on the GPU machine, after
# `pip install --no-deps --no-build-isolation -e .` (and the wheels of docs/testing.md for
# `bisect` and `tier`):
#
#     bash scripts/dev/gpu_measure.sh bisect tier quant      # issue 32's probes, issue 36
#     bash scripts/dev/gpu_measure.sh llm8192 llm4096 spec   # issues 33 and 34
#
# Parts:
#   bisect   scripts/dev/gpu_kernel_bisect.py --quick, then --variants (bf16 vs HF bf16)
#   tier     the GPU test tier (tests/gpu, 4 workers)
#   family   the bf16-vs-HF family tests that failed on the GPU before the SSD small-dot fix
#   quant    scripts/bench_quantized.py with a short budget
#   llm8192  issue 33's row through `jaxmamba bench throughput`: the 9B, 128 prompts of
#            1,024 tokens, 128 out, max_model_len 1216, 128 seqs, 8192 batched tokens, 64
#            prefill rows, memory sized by gpu_memory_utilization (the default 0.9)
#   llm4096  the same at 4096 batched tokens and 32 prefill rows
#   spec     scripts/bench_speculative.py: the 9B verify step for k = 1, 2, 4, 8 at batch
#            1 / 32 / 128 against the decode step
#   draft    train the demo model's draft (`scripts/train_demo.py --draft`, into
#            configs/nemotron-h-demo-draft, copied to $OUT/nemotron-h-demo-draft to ship)
#   e2e      single-stream tok/s of ngram and draft_model on the demo model
#            (`bench_speculative.py --e2e`; needs the draft from `draft`)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_measure}
mkdir -p "$OUT"
export JAXMAMBA_ALLOW_NO_TPU=1

part() {  # part NAME LIMIT_S COMMAND (one string, run by bash)
    local name=$1 limit=$2 start=$SECONDS
    timeout "$limit" bash -c "$3" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
    tail -n 30 "$OUT/$name.txt" | grep -v -e '^\s*$' -e 'Warning' | tail -n 24
}

llm_row() {  # llm_row TOKENS PREFILL_ROWS: the command line of one issue-33 row
    echo "jaxmamba bench throughput --model nemotron-nano-9b-v2 --dtype bfloat16" \
        "--input-len 1024 --output-len 128 --num-prompts 128 --max-model-len 1216" \
        "--max-num-seqs 128 --max-num-batched-tokens $1 --max-prefill-seqs $2" \
        "--no-enable-prefix-caching --output-json $OUT/llm$1.json"
}

for name in "$@"; do
    case $name in
        bisect)
            part bisect 200 "python3 scripts/dev/gpu_kernel_bisect.py --quick"
            part variants 80 "python3 scripts/dev/gpu_kernel_bisect.py --variants" ;;
        tier) part tier 150 "python3 -m pytest tests/gpu -n 4 -rs -q --durations=5 -p no:cacheprovider" ;;
        family) part family 200 "python3 -m pytest -n 6 -q -rs -p no:cacheprovider -k bf16 \
            tests/test_family_falcon_h1.py tests/test_family_bamba.py \
            tests/test_family_granitemoehybrid.py tests/test_family_nemotron_h_moe.py \
            tests/test_family_qwen3_5.py tests/test_family_qwen3_next.py" ;;
        quant) part quant 170 "python3 scripts/bench_quantized.py --budget-s 80" ;;
        llm8192) part llm8192 280 "$(llm_row 8192 64)" ;;
        llm4096) part llm4096 240 "$(llm_row 4096 32)" ;;
        spec) part spec 240 "python3 scripts/bench_speculative.py --ks 1 2 4 8 --out $OUT/spec.json" ;;
        draft) part draft 330 "python3 scripts/train_demo.py --draft --log-every 50 && \
            cp -r configs/nemotron-h-demo-draft $OUT/" ;;
        e2e) part e2e 300 "python3 scripts/bench_speculative.py --no-steps --e2e \
            --e2e-methods ngram draft_model --e2e-draft configs/nemotron-h-demo-draft \
            --e2e-ks 2 4 --out $OUT/spec_e2e.json" ;;
        *) echo "unknown part $name" >&2; exit 2 ;;
    esac
done
