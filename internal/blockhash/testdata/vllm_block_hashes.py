"""vLLM's prefix-cache block hashes, written from vllm/v1/core/kv_cache_utils.py and
vllm/utils/hashing.py (init_none_hash, hash_block_tokens, sha256, sha256_cbor,
maybe_convert_block_hash), for kvbridge's blockhash test: an independent source of expected
values. Reads JSON cases on stdin: [{"algo", "seed" (null: unset), "block_size", "tokens"}];
writes, per case, the 64-bit external hashes of the full blocks as decimal strings."""
import hashlib
import json
import pickle
import sys

import cbor2


def sha256(obj):
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(hash_fn, seed):
    # init_none_hash with PYTHONHASHSEED set (the unset case is random).
    return hash_fn(seed)


def hash_block_tokens(hash_fn, none, parent, tokens, extra_keys=None):
    if not parent:
        parent = none
    return hash_fn((parent, tuple(tokens), extra_keys))


def external(h):
    return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1)


out = []
for case in json.load(sys.stdin):
    fn = {"sha256": sha256, "sha256_cbor": sha256_cbor}[case["algo"]]
    none = none_hash(fn, case["seed"])
    bs, toks = case["block_size"], case["tokens"]
    parent, hashes = None, []
    for i in range(0, len(toks) - bs + 1, bs):
        parent = hash_block_tokens(fn, none, parent, toks[i:i + bs])
        hashes.append(str(external(parent)))
    out.append(hashes)
json.dump(out, sys.stdout)
