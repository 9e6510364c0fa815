#!/bin/bash
# jaxstep on a Cloud TPU pod slice: the same command on every worker VM at once.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a bash examples/launch/tpu_pod.sh
#
# --worker=all runs the command on every host of the slice. jax.distributed reads the
# slice from the TPU VM's metadata (the hosts, this worker's index), so no JAXSTEP_*
# variable and no mesh.coordinator is set. Every chip of the slice is a device of one
# mesh; mesh.data=1 mesh.fsdp=-1 shards parameters and optimizer state over all of them.
#
# run_dir must be storage every worker sees (a Filestore or other NFS mount at /shared,
# mounted on every worker first): orbax writes checkpoints from all hosts together;
# process 0 writes metrics and holds the run_dir lock. Each worker reads only its own
# chips' rows of every global batch from data.path, so the data folder is shared too.
# train.memory_budget_gb: the HBM per chip the step may use, which grad_accum_steps: auto
# needs off GPUs (85 fits a v5p chip's 95 GiB; a v4 chip has 32 GiB, a v5e chip 16 GiB).
# Every worker needs the same checkout in ~/jaxstep with jaxstep and jax[tpu] installed
# (the same gcloud ... --worker=all --command "…pip install…" first).

set -euo pipefail

TPU_NAME=${TPU_NAME:?set TPU_NAME to the pod slice}
ZONE=${ZONE:?set ZONE to the slice zone}
RUN_DIR=${RUN_DIR:-/shared/runs/gpt-1.3b}
DATA=${DATA:-/shared/data/corpus}

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command "
  cd ~/jaxstep && python -m jaxstep.train --config gpt-1.3b mesh.data=1 mesh.fsdp=-1 run_dir=$RUN_DIR data.path=$DATA train.memory_budget_gb=85
"
