package engine

import (
	"crypto/sha256"
	"encoding/binary"
	"slices"
)

// FirstToken is a request's first output token as another engine sampled it from the same
// prompt's KV (a push prefiller's max_tokens=1 answer), handed to the scheduler with the load
// that brought the whole prompt's KV (Scheduler.LoadsDone): the request then starts decoding
// from it without computing any prompt position itself. Draws is how many random numbers that
// engine's sampler drew for it (model.Sampler.Draws: 0 greedy, 1 otherwise); this engine's
// sampler skips as many, so that its next draws are the ones a single engine would make. The
// connector offers one only for a request whose FirstTokenFingerprint equals the other
// engine's and that CanTakeFirstToken.
type FirstToken struct {
	Token int32
	Draws int
}

// CanTakeFirstToken reports whether r's first token may come from another engine: r needs
// nothing only the logits give (logprobs of its tokens or of its prompt).
func (r *Request) CanTakeFirstToken() bool { return !r.Logprobs && !r.PromptLogprobs }

// FirstTokenFingerprint returns a SHA-256 of what shapes r's first sampled token besides the
// model's logits: its sampling params (model.SamplingParams.Fingerprint, seed included) and,
// when MinTokens masks the stop tokens at the first token, which ones are masked (r's stop
// token ids, and whether EOS is). Two engines of the same model with equal fingerprints sample
// the same first token for the same prompt.
func (r *Request) FirstTokenFingerprint() []byte {
	h := sha256.New()
	h.Write(r.Sampling.Fingerprint())
	var b [8]byte
	put := func(v uint64) {
		binary.LittleEndian.PutUint64(b[:], v)
		h.Write(b[:])
	}
	if r.MinTokens > 0 {
		ids := slices.Compact(slices.Sorted(slices.Values(r.StopTokenIDs)))
		if r.Stops != nil {
			ids = r.Stops.ids
		}
		put(1)
		if r.IgnoreEOS {
			put(1)
		} else {
			put(0)
		}
		put(uint64(len(ids)))
		for _, id := range ids {
			put(uint64(uint32(id)))
		}
	} else {
		put(0)
	}
	return h.Sum(nil)
}
