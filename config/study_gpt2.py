# The study's GPT-2 BPE variant, for a GPU (python study/reproduce.py --variant gpt2 --device
# cuda): the same schemes, rules and measurements as config/study_char.py, on Shakespeare in GPT-2
# tokens with a larger model. Not run by the committed results; its numbers are yours to make.
data_dir = "data/study_gpt2"
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.0

batch_size = 32
gradient_accumulation_steps = 1  # 32 sequences x 256 tokens = 8,192 tokens per iteration
max_iters = 5000
lr_decay_iters = 5000
warmup_iters = 100
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99

eval_interval = 500
eval_iters = 50
log_interval = 100
device = "cuda"
