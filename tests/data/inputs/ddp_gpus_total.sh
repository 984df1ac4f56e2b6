#!/bin/bash
#SBATCH --ntasks=8
#SBATCH --gpus=8
#SBATCH --cpus-per-gpu=6
#SBATCH --mem-per-gpu=40G
#SBATCH --time=1-12
#SBATCH --job-name=vit-l-ddp

python train_vit.py --arch vit_large --batch-size 64
