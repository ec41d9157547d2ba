# config/shakespeare_char.py trained on Shakespeare with passkey documents mixed in (`make passkey`
# prepares them: prepare_data.py --passkey 0.5 --passkey_tokens 96 --out_dir
# data/shakespeare_char_passkey), so that the tiny model learns to retrieve, for eval_retrieval.py's
# probes.
from config.shakespeare_char import *  # noqa: F401,F403

data_dir = "data/shakespeare_char_passkey"
out_dir = "out/shakespeare_char_passkey_xpos"
max_iters = 2500
lr_decay_iters = 2500
