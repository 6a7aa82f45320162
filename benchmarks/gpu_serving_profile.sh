#!/usr/bin/env bash
# Where the API process's time goes when many streams meet a fast device: the serving part of
# benchmarks/gpu_check.py (one server; c1, c16, then four runs of 256 streams of 128-token
# prompts and 256 new tokens), with py-spy on the server's API process and its children
# (device worker, encoder) for 6 s of the first 256-stream run, and the threads' CPU (top -H)
# in the middle of it. About 2 minutes on the device tool's H200.
#   here, once:  bash benchmarks/gpu_parallel_check.sh --download   (wheels, py-spy's too, into .whl/)
#   there:       bash benchmarks/gpu_serving_profile.sh             (carry .whl)
# Results in $OUT (default /tmp/out): serving.log (one JSON line a load), api.txt and
# child_PID.txt (py-spy's raw stacks: `python -m benchmarks.spy_summary api.txt` sums them up),
# top.txt, pids.txt. Arguments go to gpu_check (`--dry-run`: this script's own check on a CPU).
set -uo pipefail
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
install $(ls .whl/*.whl | grep -v py_spy)
install .whl/py_spy*.whl  # apart: a profile without it still serves
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
out=${OUT:-/tmp/out}
mkdir -p "$out"
spy=/tmp/site/bin/py-spy
python3 -m benchmarks.gpu_check --parts serving --loads 1,16,256,256,256,256 "$@" > "$out/serving.log" 2>&1 &
bench=$!
for _ in $(seq 1500); do  # the c16 result is out: the first 256-stream run has begun
    grep -q "serving 16 streams" "$out/serving.log" && break
    kill -0 $bench 2> /dev/null || break
    sleep 0.2
done
server=$(pgrep -f "pypto_serving --model" | head -1)
if [ -n "$server" ]; then
    echo "server $server children $(pgrep -P "$server" | tr '\n' ' ')" > "$out/pids.txt"
    sleep 2.5  # past the run's prefills, into its decode steps
    for pid in "$server" $(pgrep -P "$server"); do
        name=$([ "$pid" = "$server" ] && echo api || echo "child_$pid")
        timeout 30 "$spy" record --pid "$pid" --duration 6 --rate 200 --format raw --nonblocking \
            -o "$out/$name.txt" > "$out/spy_$name.log" 2>&1 &
    done
    sleep 3
    top -b -H -n 1 -w 200 | head -40 > "$out/top.txt"
fi
wait $bench
grep -v Writing "$out/serving.log"
cat "$out/pids.txt" "$out"/spy_*.log 2> /dev/null
head -25 "$out/top.txt" 2> /dev/null
