#!/usr/bin/env bash
# Two "nodes" on one machine: BucketDDP through torchrun, as on a real cluster.
#
#     bash examples/torchrun_two_nodes.sh
#
# Each torchrun invocation plays one node (--nnodes 2, --node-rank 0 or 1) with one process,
# and both meet at 127.0.0.1. On two real machines, run the same command on each with its
# own --node-rank and the first machine's address as --master-addr. Lightning detects
# torchrun's variables (TorchElasticEnvironment) and BucketDDP uses them as they are: there
# is no launcher of ours. Under SLURM, `srun python examples/lightning_swap.py --num-nodes N
# --devices M` works the same way through Lightning's SLURMEnvironment.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
PORT=${MASTER_PORT:-29517}

pids=()
for node in 0 1; do
    "$PYTHON" -m torch.distributed.run \
        --nnodes 2 --nproc-per-node 1 --node-rank "$node" \
        --master-addr 127.0.0.1 --master-port "$PORT" \
        examples/lightning_swap.py --num-nodes 2 --devices 1 "$@" &
    pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
