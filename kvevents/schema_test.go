package kvevents

import (
	"bytes"
	"fmt"
	"slices"

	"github.com/vmihailenco/msgpack/v5"
)

// A decoder written from vLLM's schema (vllm/distributed/kv_events.py), not from encode.go:
// KVEventBatch is an array_like msgspec Struct [ts, events, data_parallel_rank]; each event is
// a map-encoded Struct with tag=True (the key "type" holding the class name, first) and
// omit_defaults (fields with a default may be missing, the others may not), its keys in the
// order the class declares its fields.

// vllmFields lists each event class's fields in declaration order and how many leading ones
// have no default (so must be present).
var vllmFields = map[string]struct {
	fields   []string
	required int
}{
	"BlockStored": {[]string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"}, 7},
	"BlockRemoved":     {[]string{"block_hashes", "medium", "group_idx", "locality"}, 2},
	"AllBlocksCleared": {nil, 0},
}

// wireEvent is one decoded event.
type wireEvent struct {
	Type   string
	Fields map[string]any
}

// wireBatch is one decoded KVEventBatch.
type wireBatch struct {
	TS     float64
	Events []wireEvent
	Rank   *int64 // nil when omitted (its default)
}

// decodeWire decodes a payload by vLLM's schema, failing on anything the schema does not allow.
func decodeWire(payload []byte) (wireBatch, error) {
	var b wireBatch
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	d.UseLooseInterfaceDecoding(true)
	n, err := d.DecodeArrayLen()
	if err != nil || n < 2 || n > 3 {
		return b, fmt.Errorf("EventBatch: want an array of 2 or 3, got %d (%v)", n, err)
	}
	if b.TS, err = d.DecodeFloat64(); err != nil {
		return b, fmt.Errorf("ts: %w", err)
	}
	ne, err := d.DecodeArrayLen()
	if err != nil {
		return b, fmt.Errorf("events: %w", err)
	}
	for i := range ne {
		nk, err := d.DecodeMapLen()
		if err != nil {
			return b, fmt.Errorf("event %d: want a map: %w", i, err)
		}
		ev := wireEvent{Fields: map[string]any{}}
		var keys []string
		for k := range nk {
			key, err := d.DecodeString()
			if err != nil {
				return b, fmt.Errorf("event %d key %d: %w", i, k, err)
			}
			v, err := d.DecodeInterfaceLoose()
			if err != nil {
				return b, fmt.Errorf("event %d %s: %w", i, key, err)
			}
			if k == 0 {
				s, ok := v.(string)
				if key != "type" || !ok {
					return b, fmt.Errorf("event %d: first key %q, want the tag \"type\"", i, key)
				}
				ev.Type = s
				continue
			}
			keys = append(keys, key)
			ev.Fields[key] = v
		}
		schema, ok := vllmFields[ev.Type]
		if !ok {
			return b, fmt.Errorf("event %d: unknown type %q", i, ev.Type)
		}
		// Keys must be a subsequence of the declared fields holding every required one.
		j := 0
		for _, k := range keys {
			for j < len(schema.fields) && schema.fields[j] != k {
				if j < schema.required {
					return b, fmt.Errorf("event %d (%s): required field %s missing or out of order (keys %v)", i, ev.Type, schema.fields[j], keys)
				}
				j++
			}
			if j == len(schema.fields) {
				return b, fmt.Errorf("event %d (%s): field %s unknown or out of order (keys %v)", i, ev.Type, k, keys)
			}
			j++
		}
		if j < schema.required {
			return b, fmt.Errorf("event %d (%s): required fields missing (keys %v, want %v)", i, ev.Type, keys, schema.fields[:schema.required])
		}
		b.Events = append(b.Events, ev)
	}
	if n == 3 {
		r, err := d.DecodeInt64()
		if err != nil {
			return b, fmt.Errorf("data_parallel_rank: %w", err)
		}
		b.Rank = &r
	}
	if rest, _ := d.Buffered().Read(make([]byte, 1)); rest != 0 {
		return b, fmt.Errorf("trailing bytes after the batch")
	}
	return b, nil
}

// uints returns v (a decoded msgpack array of non-negative integers) as uint64s, or nil.
func uints(v any) []uint64 {
	a, ok := v.([]any)
	if !ok {
		return nil
	}
	out := make([]uint64, 0, len(a))
	for _, x := range a {
		switch x := x.(type) {
		case uint64:
			out = append(out, x)
		case int64:
			if x < 0 {
				return nil
			}
			out = append(out, uint64(x))
		default:
			return nil
		}
	}
	return out
}

// hasKeys reports whether ev has exactly these fields besides its type.
func (ev wireEvent) hasKeys(keys ...string) bool {
	got := make([]string, 0, len(ev.Fields))
	for k := range ev.Fields {
		got = append(got, k)
	}
	slices.Sort(got)
	keys = slices.Clone(keys)
	slices.Sort(keys)
	return slices.Equal(got, keys)
}
