package engine

import (
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
)

// Sequence is the scheduler's state of one request: its tokens (prompt then output), how many of
// them have KV in its blocks, its block table and its status. Connector hooks receive it; its
// methods are read-only and must be called on the scheduler owner's goroutine only.
type Sequence struct {
	id        string
	req       *Request
	tokens    []int32 // prompt then output
	numPrompt int
	status    Status

	numComputed int                 // leading tokens whose KV is in the blocks
	table       *kvcache.BlockTable // blocks in position order, hash chain, committed count

	localHit       int  // tokens from the local prefix cache at the latest admission
	external       int  // tokens the connector supplies at the latest admission
	cachedTokens   int  // local hit + external at the first admission (reported to the client)
	externalCached int  // the part of cachedTokens the connector supplied
	admitted       bool // the first admission happened (stats recorded)
	preemptions    int
	stopToken      bool // finished by EOS or a stop token id: the last token's text is not emitted
	firstDraws     int  // random numbers the sampler drew for the first output token

	arrival, firstToken, finishedAt time.Time
	scheduledAt, lastToken          time.Time // first time it ran; its latest token
}

// ID returns the request id.
func (q *Sequence) ID() string { return q.id }

// Request returns the request as added (do not modify it).
func (q *Sequence) Request() *Request { return q.req }

// KVTransfer returns the request's kv_transfer_params (do not modify it).
func (q *Sequence) KVTransfer() map[string]any { return q.req.KVTransfer }

// Status returns the request's state.
func (q *Sequence) Status() Status { return q.status }

// Prompt returns the prompt tokens (do not modify them).
func (q *Sequence) Prompt() []int32 { return q.tokens[:q.numPrompt:q.numPrompt] }

// Output returns the generated tokens so far (do not modify them).
func (q *Sequence) Output() []int32 { return q.tokens[q.numPrompt:len(q.tokens):len(q.tokens)] }

// Tokens returns prompt then output tokens (do not modify them).
func (q *Sequence) Tokens() []int32 { return q.tokens[:len(q.tokens):len(q.tokens)] }

// NumTokens returns the number of prompt plus output tokens.
func (q *Sequence) NumTokens() int { return len(q.tokens) }

// NumPromptTokens returns the prompt length.
func (q *Sequence) NumPromptTokens() int { return q.numPrompt }

// NumOutputTokens returns the number of generated tokens.
func (q *Sequence) NumOutputTokens() int { return len(q.tokens) - q.numPrompt }

// NumComputed returns how many leading tokens have their KV in the blocks (vLLM's
// num_computed_tokens). While WAITING_FOR_REMOTE_KVS it already counts the tokens being loaded.
func (q *Sequence) NumComputed() int { return q.numComputed }

// Blocks returns the block table in position order: position p is in Blocks()[p/BlockSize].
// Do not modify it; it is valid until the scheduler next changes the table.
func (q *Sequence) Blocks() []int32 { return q.table.IDs() }

// BlockHashes returns the prefix-hash chain of the request's full blocks computed so far.
func (q *Sequence) BlockHashes() []kvcache.BlockHash { return q.table.Hashes() }

// NumLocalHitTokens returns the local prefix-cache hit of the latest admission, in tokens.
func (q *Sequence) NumLocalHitTokens() int { return q.localHit }

// NumExternalTokens returns the tokens the connector supplied at the latest admission.
func (q *Sequence) NumExternalTokens() int { return q.external }

// CachedTokens returns the prompt tokens not computed here at the first admission: the
// prefix-cache hit plus the connector's tokens (usage.prompt_tokens_details.cached_tokens).
// A recompute after a failed load lowers it to what was really kept.
func (q *Sequence) CachedTokens() int { return q.cachedTokens }

// ExternalCachedTokens returns the part of CachedTokens that the connector supplied (pulled
// from a remote engine) rather than the local prefix cache.
func (q *Sequence) ExternalCachedTokens() int { return min(q.externalCached, q.cachedTokens) }

// NumPreemptions returns how many times the request was preempted.
func (q *Sequence) NumPreemptions() int { return q.preemptions }

// StoppedByToken reports whether the request finished because it sampled EOS or a stop token
// id (that last token's text is not part of the output).
func (q *Sequence) StoppedByToken() bool { return q.stopToken }

// Arrival returns the time the request was added.
func (q *Sequence) Arrival() time.Time { return q.arrival }

// FirstTokenAt returns the time its first token was sampled (zero before).
func (q *Sequence) FirstTokenAt() time.Time { return q.firstToken }

// FinishedAt returns the time it finished (zero before).
func (q *Sequence) FinishedAt() time.Time { return q.finishedAt }

// ScheduledAt returns the first time the request was scheduled to run (zero before). A request
// that waits for its connector's KV load runs only once the load is done, as in vLLM.
func (q *Sequence) ScheduledAt() time.Time { return q.scheduledAt }

// LastTokenAt returns the time its latest token was sampled (zero before the first).
func (q *Sequence) LastTokenAt() time.Time { return q.lastToken }

// FirstTokenDraws returns how many random numbers the engine's sampler drew for the first
// output token (0 before it, or in greedy mode): what a push prefiller tells its decoder with
// that token (FirstToken).
func (q *Sequence) FirstTokenDraws() int { return q.firstDraws }

// PromptSources splits the prompt by where its KV came from, as vLLM's PromptTokenStats does at
// the request's first token: computed here (the prompt less the cached tokens reported to the
// client), found in the local prefix cache, and supplied by the connector. When the connector
// supplied the whole prompt, its last token is computed here all the same (for its logits) and
// counts in both computed and external, as in vLLM. (A prompt the local prefix cache serves but
// its last token counts that token once, as computed; vLLM counts it as a cache hit as well.)
func (q *Sequence) PromptSources() (computed, localHit, external int) {
	ext := q.ExternalCachedTokens()
	return q.numPrompt - q.cachedTokens, q.cachedTokens - ext, max(ext, min(q.external, q.numPrompt))
}
