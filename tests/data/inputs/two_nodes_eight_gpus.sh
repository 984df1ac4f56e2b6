#!/bin/bash
#SBATCH --job-name=llama-8b-ft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=32
#SBATCH --time=30

echo "task ${SLURM_PROCID:-?} of ${SLURM_NTASKS:-?} on node ${SLURM_NODEID:-?} of ${SLURM_NNODES:-?}" \
     "(torchrun: rank ${RANK:-?}, node rank ${NODE_RANK:-?}) on $(hostname)"
