# A tiny character-level xPos model on the offline Shakespeare corpus (prepare_data.py --dataset
# shakespeare --tokenizer char). Trains in a few minutes on 2 CPU cores; the other schemes' files
# change only `pos`.
out_dir = "out/shakespeare_char_xpos"
data_dir = "data/shakespeare_char"
pos = "xpos"

block_size = 128
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

batch_size = 16
gradient_accumulation_steps = 2  # a global batch of 32 sequences, on 1 process or (torchrun) on 2
max_iters = 1000
lr_decay_iters = 1000
warmup_iters = 50
learning_rate = 2e-3
min_lr = 2e-4
beta2 = 0.99  # small batches: a shorter second-moment memory, as nanoGPT's shakespeare_char config

eval_interval = 250
eval_iters = 20
log_interval = 50
device = "cpu"
