#!/bin/bash
source /work/venv/bin/activate
cd /tmp/cp
for i in 1 2; do
uptime > before$i.load
PYTHONPATH=/tmp/before_site python -m weight_transfer.benchmarks.bench_control_plane --members 8,64,384 --updates 10 --json before$i.json > before$i.log 2>&1
uptime > after$i.load
python -m weight_transfer.benchmarks.bench_control_plane --members 8,64,384 --updates 10 --json after$i.json > after$i.log 2>&1
done
echo done > finished
