package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbridge/kvbridge/internal/msgpackcheck"
)

// Decoding vLLM's KVEventBatch (vllm/distributed/kv_events.py), written from vLLM's schema, not
// from kvbridge's encoder: EventBatch is msgspec array_like with omit_defaults,
// [ts, events, data_parallel_rank?]; each event is tagged — a map whose "type" names the class
// (current vLLM), or an array whose first element is the tag (vLLM before lora_name and medium).
// Only what routing needs is kept: the kind, the block hashes and the block size. A block hash is
// the uint64 vLLM's maybe_convert_block_hash gives (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the
// default), or raw bytes (=0), of which the last 8 read big-endian are the same integer.

// Limits on one event batch: it comes from an engine the operator named, but is still decoded
// as untrusted input (bounded, never a panic).
const (
	maxKVEventPayload   = 16 << 20
	maxKVEventsPerBatch = 1 << 16
	maxKVEventDepth     = 6
)

// The event kinds routing reads.
const (
	kvBlockStored      = "BlockStored"
	kvBlockRemoved     = "BlockRemoved"
	kvAllBlocksCleared = "AllBlocksCleared"
)

// kvEvent is one decoded event.
type kvEvent struct {
	kind      string
	hashes    []uint64
	blockSize int
}

// kvBatch is one decoded KVEventBatch.
type kvBatch struct {
	events []kvEvent
	rank   int // data_parallel_rank, -1 when absent
}

// errKVEvent wraps every decoding failure.
var errKVEvent = errors.New("proxy: malformed KV event batch")

// decodeKVBatch decodes a batch's msgpack payload.
func decodeKVBatch(payload []byte) (kvBatch, error) {
	if len(payload) > maxKVEventPayload {
		return kvBatch{}, fmt.Errorf("%w: %d bytes (at most %d)", errKVEvent, len(payload), maxKVEventPayload)
	}
	n, err := msgpackcheck.Check(payload, maxKVEventDepth)
	if err == nil && n != len(payload) {
		err = fmt.Errorf("%d bytes after the batch", len(payload)-n)
	}
	if err != nil {
		return kvBatch{}, fmt.Errorf("%w: %w", errKVEvent, err)
	}
	b, err := decodeBatchFields(msgpack.NewDecoder(bytes.NewReader(payload)))
	if err != nil {
		return kvBatch{}, fmt.Errorf("%w: %w", errKVEvent, err)
	}
	return b, nil
}

func decodeBatchFields(d *msgpack.Decoder) (kvBatch, error) {
	b := kvBatch{rank: -1}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return b, fmt.Errorf("batch: %w", err)
	}
	if n < 2 {
		return b, fmt.Errorf("batch: an array of %d fields, want [ts, events, data_parallel_rank?]", n)
	}
	if _, err := d.DecodeFloat64(); err != nil {
		return b, fmt.Errorf("ts: %w", err)
	}
	ne, err := d.DecodeArrayLen()
	if err != nil {
		return b, fmt.Errorf("events: %w", err)
	}
	if ne > maxKVEventsPerBatch {
		return b, fmt.Errorf("events: %d (at most %d)", ne, maxKVEventsPerBatch)
	}
	for i := range max(ne, 0) {
		ev, err := decodeEvent(d)
		if err != nil {
			return b, fmt.Errorf("event %d: %w", i, err)
		}
		b.events = append(b.events, ev)
	}
	if n >= 3 {
		v, err := d.DecodeInterfaceLoose()
		if err != nil {
			return b, fmt.Errorf("data_parallel_rank: %w", err)
		}
		switch r := v.(type) {
		case nil:
		case int64:
			if r < 0 || r > 1<<16 {
				return b, fmt.Errorf("data_parallel_rank %d out of range", r)
			}
			b.rank = int(r)
		case uint64:
			if r > 1<<16 {
				return b, fmt.Errorf("data_parallel_rank %d out of range", r)
			}
			b.rank = int(r)
		default:
			return b, fmt.Errorf("data_parallel_rank: %T, want an integer", v)
		}
	}
	for range n - 3 { // fields a later vLLM may add
		if err := d.Skip(); err != nil {
			return b, err
		}
	}
	return b, nil
}

// decodeEvent decodes a tagged event: a map with "type", or an array led by the tag.
func decodeEvent(d *msgpack.Decoder) (kvEvent, error) {
	var ev kvEvent
	code, err := d.PeekCode()
	if err != nil {
		return ev, err
	}
	if isArrayCode(code) {
		return decodeArrayEvent(d)
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return ev, fmt.Errorf("want a map or an array: %w", err)
	}
	for range max(n, 0) {
		key, err := d.DecodeString()
		if err != nil {
			return ev, fmt.Errorf("key: %w", err)
		}
		switch key {
		case "type":
			if ev.kind, err = d.DecodeString(); err != nil {
				return ev, fmt.Errorf("type: %w", err)
			}
		case "block_hashes":
			if ev.hashes, err = decodeHashes(d); err != nil {
				return ev, fmt.Errorf("block_hashes: %w", err)
			}
		case "block_size":
			if ev.blockSize, err = decodeBlockSize(d); err != nil {
				return ev, err
			}
		default:
			if err := d.Skip(); err != nil {
				return ev, fmt.Errorf("%s: %w", key, err)
			}
		}
	}
	return ev, checkEvent(ev)
}

// decodeArrayEvent decodes the array-like layout: [tag, block_hashes, parent_block_hash,
// token_ids, block_size, …] for BlockStored, [tag, block_hashes, …] for BlockRemoved, [tag]
// for AllBlocksCleared.
func decodeArrayEvent(d *msgpack.Decoder) (kvEvent, error) {
	var ev kvEvent
	n, err := d.DecodeArrayLen()
	if err != nil || n < 1 {
		return ev, fmt.Errorf("an empty or unreadable event array: %v", err)
	}
	if ev.kind, err = d.DecodeString(); err != nil {
		return ev, fmt.Errorf("tag: %w", err)
	}
	for i := 1; i < n; i++ {
		switch {
		case i == 1 && ev.kind != kvAllBlocksCleared:
			ev.hashes, err = decodeHashes(d)
		case i == 4 && ev.kind == kvBlockStored:
			ev.blockSize, err = decodeBlockSize(d)
		default:
			err = d.Skip()
		}
		if err != nil {
			return ev, fmt.Errorf("field %d: %w", i, err)
		}
	}
	return ev, checkEvent(ev)
}

func checkEvent(ev kvEvent) error {
	switch ev.kind {
	case kvBlockStored, kvBlockRemoved, kvAllBlocksCleared:
		return nil
	case "":
		return errors.New("no type")
	}
	return nil // an event routing does not read (a later vLLM's): ignored
}

func isArrayCode(c byte) bool { return c >= 0x90 && c <= 0x9f || c == 0xdc || c == 0xdd }

func decodeBlockSize(d *msgpack.Decoder) (int, error) {
	bs, err := d.DecodeInt64()
	if err != nil {
		return 0, fmt.Errorf("block_size: %w", err)
	}
	if bs <= 0 || bs > 1<<16 {
		return 0, fmt.Errorf("block_size %d out of range", bs)
	}
	return int(bs), nil
}

// decodeHashes decodes an array of block hashes: integers, or bytes whose last 8 are the hash.
func decodeHashes(d *msgpack.Decoder) ([]uint64, error) {
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, 0, max(n, 0))
	for range max(n, 0) {
		c, err := d.PeekCode()
		if err != nil {
			return nil, err
		}
		if c == 0xc4 || c == 0xc5 || c == 0xc6 { // bin 8, 16, 32
			h, err := d.DecodeBytes()
			if err != nil {
				return nil, err
			}
			var last [8]byte
			copy(last[8-min(len(h), 8):], h[max(len(h)-8, 0):])
			out = append(out, binary.BigEndian.Uint64(last[:]))
			continue
		}
		v, err := d.DecodeInterfaceLoose()
		if err != nil {
			return nil, err
		}
		switch h := v.(type) {
		case uint64:
			out = append(out, h)
		case int64:
			out = append(out, uint64(h))
		default:
			return nil, fmt.Errorf("a hash of type %T, want an integer or bytes", v)
		}
	}
	return out, nil
}
