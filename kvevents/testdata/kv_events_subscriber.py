#!/usr/bin/env python3
"""A KV cache event subscriber written from vLLM's schema (vllm/distributed/kv_events.py), not
from kvbridge's encoder: the tests run it against a real kvbridge engine.

Wire format it expects, per vLLM:
  * the PUB socket sends multipart [topic, seq (8 bytes big-endian), payload];
  * payload is msgpack of KVEventBatch, an array_like msgspec Struct: [ts, events,
    data_parallel_rank] (trailing defaults may be omitted);
  * each event is a map-encoded, tagged Struct: the tag key "type" first (the class name), then
    the class's fields in declaration order, fields equal to their default omitted;
  * the replay ROUTER takes [empty, start seq (8 bytes big-endian)] and answers
    [empty, seq, payload] per kept batch, then [empty, -1 (8 bytes), empty].

With PYTHONHASHSEED in its environment it also recomputes each stored block's hash as vLLM does
(vllm/v1/core/kv_cache_utils.py hash_block_tokens, with --hash-algo's function: sha256 pickles,
sha256_cbor CBOR-encodes) from the event's token ids and its parent's hash, and prints the
64-bit results as "vllm_hashes" beside the engine's "block_hashes" (null when the parent was
never seen, so its full hash is unknown).

It binds a SUB socket on --bind (a free port of that tcp host, printed as {"ready": ...}), so the
engine connects to it (vLLM's connect mode for an endpoint without "*"), and reads commands on
stdin: "replay N ENDPOINT" asks the replay socket at ENDPOINT (from an anonymous DEALER) for the
batches from N on; "quit" exits.
Every message becomes one JSON line on stdout.
"""

import argparse
import hashlib
import json
import os
import pickle
import sys

import msgpack
import zmq

# Fields of each event class in declaration order, and how many leading ones have no default.
SCHEMA = {
    "BlockStored": (["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                     "kv_cache_spec_sliding_window", "locality"], 7),
    "BlockRemoved": (["block_hashes", "medium", "group_idx", "locality"], 2),
    "AllBlocksCleared": ([], 0),
}

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Hasher:
    """vLLM's block hashes: init_none_hash, hash_block_tokens, maybe_convert_block_hash."""

    def __init__(self, algo, seed):
        if algo == "sha256_cbor":
            import cbor2
            self.fn = lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
        else:
            self.fn = lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        self.none = self.fn(seed)
        self.full = {}  # 64-bit external hash -> full hash, of every block seen stored

    @staticmethod
    def external(h):
        return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1)

    def stored(self, parent, token_ids, block_size):
        if parent is None:
            prev = self.none
        elif parent in self.full:
            prev = self.full[parent]
        else:
            return None
        out = []
        for i in range(0, len(token_ids), block_size):
            prev = self.fn((prev, tuple(token_ids[i:i + block_size]), None))
            ext = self.external(prev)
            self.full[ext] = prev
            out.append(ext)
        return out


HASHER = None


class SchemaError(Exception):
    pass


def decode_batch(payload):
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3:
        raise SchemaError(f"EventBatch must be an array of 2 or 3, got {batch!r:.200}")
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, float):
        raise SchemaError(f"ts must be a float, got {ts!r}")
    if rank is not None and not isinstance(rank, int):
        raise SchemaError(f"data_parallel_rank must be an int, got {rank!r}")
    out = []
    for ev in events:
        if not isinstance(ev, dict):
            raise SchemaError(f"event must be a map, got {ev!r:.200}")
        keys = list(ev)
        if not keys or keys[0] != "type":
            raise SchemaError(f"first key must be the tag 'type', got {keys}")
        kind = ev["type"]
        if kind not in SCHEMA:
            raise SchemaError(f"unknown event type {kind!r}")
        fields, required = SCHEMA[kind]
        rest = keys[1:]
        # The keys must follow declaration order and hold every required field.
        positions = []
        for k in rest:
            if k not in fields:
                raise SchemaError(f"{kind}: unknown field {k!r}")
            positions.append(fields.index(k))
        if positions != sorted(positions):
            raise SchemaError(f"{kind}: fields out of declaration order: {rest}")
        missing = [f for f in fields[:required] if f not in rest]
        if missing:
            raise SchemaError(f"{kind}: required fields missing: {missing}")
        for k in ("block_hashes",):
            if k in ev and not all(isinstance(h, (int, bytes)) for h in ev[k]):
                raise SchemaError(f"{kind}: {k} must hold ints or bytes")
        d = {k: ev[k] for k in keys}
        if HASHER is not None and kind == "BlockStored":
            d["vllm_hashes"] = HASHER.stored(ev.get("parent_block_hash"), ev["token_ids"], ev["block_size"])
        for k in ("block_hashes",):
            if k in d:
                d[k] = [h if isinstance(h, int) else h.hex() for h in d[k]]
        out.append(d)
    return {"ts": ts, "rank": rank, "events": out}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def replay(sock, start):
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        if not sock.poll(20000):
            raise SchemaError("replay: no answer within 20 s")
        frames = sock.recv_multipart()
        if len(frames) != 3 or frames[0] != b"":
            raise SchemaError(f"replay: reply of {len(frames)} frames, want [empty, seq, payload]")
        if frames[1] == END_SEQ:
            if frames[2] != b"":
                raise SchemaError("replay: end marker with a payload")
            return batches
        seq = int.from_bytes(frames[1], "big")
        batches.append({"seq": seq, "batch": decode_batch(frames[2])})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True, help="tcp://HOST: bind the SUB socket on a free port")
    ap.add_argument("--topic", default="")
    ap.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor"])
    args = ap.parse_args()
    global HASHER
    if "PYTHONHASHSEED" in os.environ:
        HASHER = Hasher(args.hash_algo, os.environ["PYTHONHASHSEED"])

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    port = sub.bind_to_random_port(args.bind)
    emit({"ready": {"port": port}})

    dealers = {}  # replay endpoint -> DEALER
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    while True:
        for item, _ in poller.poll():
            if item is sub:
                topic, seq, payload = sub.recv_multipart()
                try:
                    if len(seq) != 8:
                        raise SchemaError(f"sequence frame of {len(seq)} bytes")
                    emit({"live": {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                                   "batch": decode_batch(payload)}})
                except SchemaError as e:
                    emit({"error": str(e)})
                continue
            line = sys.stdin.readline()
            if not line or line.strip() == "quit":
                return
            cmd = line.split()
            if cmd[0] == "replay":
                if cmd[2] not in dealers:
                    dealers[cmd[2]] = ctx.socket(zmq.DEALER)  # anonymous: no identity set
                    dealers[cmd[2]].connect(cmd[2])
                try:
                    emit({"replay": {"start": int(cmd[1]), "batches": replay(dealers[cmd[2]], int(cmd[1]))}})
                except SchemaError as e:
                    emit({"error": str(e)})


if __name__ == "__main__":
    main()
