package kvevents

import (
	"bytes"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/vmihailenco/msgpack/v5"
)

// MediumGPU is vLLM's MEDIUM_GPU, the medium of every block kvbridge's pool holds (the engine's
// KV cache, whatever memory backs it).
const MediumGPU = "GPU"

// batch is one step's events with the time they were drained.
type batch struct {
	ts     time.Time
	events []kvcache.Event
}

// encodeBatch encodes one KVEventBatch as vLLM's msgspec encoder does:
//
//   - EventBatch is array_like: [ts (float64 seconds), events, data_parallel_rank]; the rank is
//     always set, as ZmqEventPublisher.publish sets it.
//   - each event is a tagged, map-encoded struct with omit_defaults: the tag "type" (the class
//     name) first, then the fields in declaration order, fields at their default left out:
//     BlockStored {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//     lora_name}, BlockRemoved {type, block_hashes, medium}, AllBlocksCleared {type}.
//
// Consecutive stored blocks of one chain (each the parent of the next) become one BlockStored,
// as vLLM's cache_full_blocks emits one per request and step; consecutive removals become one
// BlockRemoved.
func encodeBatch(b batch, rank, blockSize int) ([]byte, error) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	groups := group(b.events)
	ts := float64(b.ts.UnixNano()) / 1e9
	err := firstErr(
		enc.EncodeArrayLen(3),
		enc.EncodeFloat64(ts),
		enc.EncodeArrayLen(len(groups)),
	)
	for _, g := range groups {
		if err != nil {
			break
		}
		err = encodeEvent(enc, g, blockSize)
	}
	if err == nil {
		err = enc.EncodeInt(int64(rank))
	}
	return buf.Bytes(), err
}

// encodeEvent encodes one grouped event.
func encodeEvent(enc *msgpack.Encoder, g []kvcache.Event, blockSize int) error {
	switch g[0].Kind {
	case kvcache.EventStored:
		err := firstErr(enc.EncodeMapLen(8), enc.EncodeString("type"), enc.EncodeString("BlockStored"),
			enc.EncodeString("block_hashes"), encodeHashes(enc, g),
			enc.EncodeString("parent_block_hash"))
		if err != nil {
			return err
		}
		if first := g[0]; first.Tokens != nil && first.Parent != (kvcache.BlockHash{}) {
			err = enc.EncodeUint(first.ParentExternal)
		} else {
			err = enc.EncodeNil()
		}
		if err != nil {
			return err
		}
		n := 0
		for _, e := range g {
			n += len(e.Tokens)
		}
		if err := firstErr(enc.EncodeString("token_ids"), enc.EncodeArrayLen(n)); err != nil {
			return err
		}
		for _, e := range g {
			for _, t := range e.Tokens {
				if err := enc.EncodeInt(int64(t)); err != nil {
					return err
				}
			}
		}
		return firstErr(enc.EncodeString("block_size"), enc.EncodeInt(int64(blockSize)),
			enc.EncodeString("lora_id"), enc.EncodeNil(),
			enc.EncodeString("medium"), enc.EncodeString(MediumGPU),
			enc.EncodeString("lora_name"), enc.EncodeNil())
	case kvcache.EventRemoved:
		return firstErr(enc.EncodeMapLen(3), enc.EncodeString("type"), enc.EncodeString("BlockRemoved"),
			enc.EncodeString("block_hashes"), encodeHashes(enc, g),
			enc.EncodeString("medium"), enc.EncodeString(MediumGPU))
	default:
		return firstErr(enc.EncodeMapLen(1), enc.EncodeString("type"), enc.EncodeString("AllBlocksCleared"))
	}
}

// encodeHashes encodes the external hashes of g's blocks as an array.
func encodeHashes(enc *msgpack.Encoder, g []kvcache.Event) error {
	if err := enc.EncodeArrayLen(len(g)); err != nil {
		return err
	}
	for _, e := range g {
		if err := enc.EncodeUint(e.External); err != nil {
			return err
		}
	}
	return nil
}

// group splits events into runs that encode as one vLLM event: a chain of stored blocks (each
// with tokens, the parent of the next), a run of removals, or a single clear.
func group(evs []kvcache.Event) [][]kvcache.Event {
	var out [][]kvcache.Event
	for i := 0; i < len(evs); {
		j := i + 1
		switch evs[i].Kind {
		case kvcache.EventStored:
			for j < len(evs) && evs[j].Kind == kvcache.EventStored && evs[j].Tokens != nil &&
				evs[j-1].Tokens != nil && evs[j].Parent == evs[j-1].Hash {
				j++
			}
		case kvcache.EventRemoved:
			for j < len(evs) && evs[j].Kind == kvcache.EventRemoved {
				j++
			}
		}
		out = append(out, evs[i:j])
		i = j
	}
	return out
}

// firstErr returns the first non-nil error: the encoder's calls are made in order, and each
// writes to a bytes.Buffer, which does not fail.
func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
