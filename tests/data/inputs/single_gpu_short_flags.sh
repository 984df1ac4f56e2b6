#!/bin/bash
#SBATCH -J finetune-bert          # job name
#SBATCH -p gpu                    # partition
#SBATCH -c 8                      # cores for the dataloader
#SBATCH -t 0-04:00                # 4 hours
#SBATCH --gres=gpu:1
#SBATCH --mem=32G
#SBATCH -o slurm-%j.out

# environment
module purge
module load cuda/12.1 anaconda3
source activate bert

python run_glue.py --model_name_or_path bert-base-cased --task_name mrpc --do_train --output_dir out/
