# config/shakespeare_char.py trained on Shakespeare with passkey documents mixed in (prepare_data.py --passkey 0.3
# --out_dir data/shakespeare_char_passkey): teaches the tiny model to retrieve, for eval_retrieval.py's probes.
from config.shakespeare_char import *  # noqa: F401,F403

data_dir = "data/shakespeare_char_passkey"
out_dir = "out/shakespeare_char_passkey_xpos"
max_iters = 1500
lr_decay_iters = 1500
