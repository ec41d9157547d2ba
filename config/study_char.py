# The small-scale study's shared recipe (reproduce.py): every scheme trains with exactly these
# settings on the same data, token budget and seeds; reproduce.py changes only pos (xPos's
# scale_base and rotation for its variants), seed and out_dir. A tiny character-level GPT on the
# offline Shakespeare corpus, training length 128.
data_dir = "data/study_char"
block_size = 128
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

batch_size = 16
gradient_accumulation_steps = 2  # 32 sequences x 128 tokens = 4,096 tokens per iteration
max_iters = 1000  # 4.1M tokens per run
lr_decay_iters = 1000
warmup_iters = 50
# The rate that costs no scheme more than about 1% of its best final loss (python study/reproduce.py
# --tune, results/char/tuning.json): learned, rope and xpos do best at 8e-3 but lose at most 1.2%
# here, while at 8e-3 sinusoidal and none, which do best here, lose 11% and 6%.
learning_rate = 4e-3
min_lr = 4e-4
beta2 = 0.99

eval_interval = 250
eval_iters = 20
log_interval = 50
device = "cpu"
