# The paper's pre-training recipe (§4.1), for GPU users: a GPT-3-medium-sized LeX Transformer
# (xPos; BCA is inference-only, see eval_extrapolate.py) trained at length 1024. Set pos to compare
# schemes as in Table 2. The paper trains on a Pile subset that is not shipped here: prepare your
# own corpus with GPT-2 BPE, e.g.
#   python prepare_data.py --dataset files --path 'corpus/**/*.txt' --tokenizer gpt2 \
#       --out_dir data/corpus_gpt2
# then: torchrun --standalone --nproc_per_node=8 train.py config/paper_lex_350m.py
out_dir = "out/paper_lex_350m"
data_dir = "data/corpus_gpt2"
pos = "xpos"

n_layer = 24
n_head = 16
n_embd = 1024
block_size = 1024
dropout = 0.0  # not stated in the paper
bias = True

# 0.5M tokens per step: 512 sequences of 1024 = batch_size x gradient_accumulation_steps (global,
# split over GPUs)
batch_size = 8
gradient_accumulation_steps = 64

# Adam, beta = (0.9, 0.98), eps = 1e-6, lr 3e-4 with polynomial decay (paper §4.1)
learning_rate = 3e-4
beta1 = 0.9
beta2 = 0.98
adam_eps = 1e-6
lr_schedule = "polynomial"
lr_power = 1.0
min_lr = 0.0
weight_decay = 0.01  # not stated in the paper; torchscale's language-model examples use 0.01
warmup_iters = 375  # not stated in the paper
max_iters = 50000  # not stated in the paper
lr_decay_iters = 50000
grad_clip = 1.0

eval_interval = 1000
eval_iters = 100
log_interval = 10
dtype = "auto"  # bf16 on A100/H100, float16 + GradScaler on V100 (the paper's 16 x V100)
compile = True
