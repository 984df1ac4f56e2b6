#!/bin/bash
#SBATCH --job-name=tokenize-shards
#SBATCH --partition=cpu
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --mem-per-cpu=4G
#SBATCH --time=12:00:00
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=someone@example.org

python tokenize_shards.py --workers 16 --input raw/ --output tokens/
