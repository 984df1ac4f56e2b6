#!/bin/bash
#SBATCH --dependency=afterok:4242
#SBATCH --gres=gpu:1
#SBATCH -t 30

python eval.py --ckpt runs/latest.pt
