package openai

import (
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// The bounds of request fields, all in one place. A request beyond one gets a 400 naming the
// field and the bound. The body itself is bounded by Config.MaxBodyBytes, but within it a
// client could still ask for work or memory it does not use: a list stored once per sequence,
// a check repeated on every token of every sequence in the shared step loop, a response many
// times the request. vLLM bounds only logprobs (--max-logprobs) and, on the generation routes,
// the prompt (max_model_len); kvbridge bounds every list as well, generously, with a reason
// given for each.
//
// Bounds that depend on the model:
//   - stop_token_ids, logit_bias and allowed_token_ids hold at most the vocabulary's size of
//     entries: a longer list repeats ids and says nothing more.
//   - logprobs, top_logprobs and prompt_logprobs are at most --max-logprobs (Config.MaxLogprobs).
//   - The prompt of /tokenize, like that of the generation routes, is at most max_model_len
//     tokens (vLLM counts any prompt there; a longer one cannot be served, and its ids would
//     make a response many times the request). On every route a text too long to encode to
//     that many tokens is refused before it is encoded (maxPromptBytes).
//   - /detokenize takes at most max_model_len ids (the longest sequence the model holds).
const (
	// maxChoices bounds n and best_of: one request may not queue more sequences than this (each
	// also takes a MaxConcurrentRequests slot, at most the whole limit).
	maxChoices = 256

	// maxStopStrings bounds the number of stop strings. OpenAI takes 4; vLLM has no bound.
	// Their matcher is built once per request, so the number costs only memory and build time.
	maxStopStrings = 1024
	// maxStopStringBytes bounds one stop string: the matcher holds back up to this many bytes
	// of output that could still start one, and a longer one cannot be meant as a stop.
	maxStopStringBytes = 4096
	// maxStopBytes bounds the bytes of all stop strings together, which size the request's
	// stop matcher (about 20 bytes per byte of stop string, once per request).
	maxStopBytes = 64 << 10

	// maxBadWords and maxBadWordTokens bound bad_words: the words, and the tokens of their
	// encodings (with the leading-space variants), since the sampler checks every one of them
	// at every step of every sequence of the shared step loop.
	maxBadWords      = 1024
	maxBadWordTokens = 16384

	// tokenTextSlack is how many times the longest token's bytes a prompt's text may take per
	// token before it is refused unencoded: normalizers (NFKC, lowercasing) shrink a text by
	// far less than this.
	tokenTextSlack = 4

	// maxListedIDs bounds the out-of-vocabulary ids an error message lists.
	maxListedIDs = 16
)

// maxPromptBytes returns the most bytes of text that may encode to maxModelLen tokens or
// fewer: every token covers at most the longest token's bytes (with tokenTextSlack for
// normalization).
func maxPromptBytes(tok *tokenizer.Tokenizer, maxModelLen int) int {
	longest := 1
	for id := range tok.VocabSize() {
		longest = max(longest, len(tok.TokenBytes(int32(id))))
	}
	return maxModelLen * longest * tokenTextSlack
}

// checkPromptBytes refuses, before encoding it, a prompt text (of the field param) too long to
// encode to max_model_len tokens or fewer (Server.promptBytes): encoding it would cost memory
// and time only to refuse it then.
func (s *Server) checkPromptBytes(param string, n int) *APIError {
	if n > s.promptBytes {
		return badRequest(param, "This model's maximum context length is %d tokens; a text of %d bytes is longer than any text of that many tokens.", s.cfg.MaxModelLen, n)
	}
	return nil
}

// checkCount returns a 400 naming param if a list of n entries exceeds limit.
func checkCount(param string, n, limit int, what string) *APIError {
	if n > limit {
		return badRequest(param, "%s may hold at most %d %s, got %d.", param, limit, what, n)
	}
	return nil
}

// checkStops checks the stop strings against maxStopStrings, maxStopStringBytes and
// maxStopBytes.
func checkStops(stops []string) *APIError {
	if apiErr := checkCount("stop", len(stops), maxStopStrings, "strings"); apiErr != nil {
		return apiErr
	}
	total := 0
	for i, s := range stops {
		if len(s) > maxStopStringBytes {
			return badRequest("stop", "stop strings may be at most %d bytes long, got %d bytes in stop[%d].", maxStopStringBytes, len(s), i)
		}
		total += len(s)
	}
	if total > maxStopBytes {
		return badRequest("stop", "stop strings may be at most %d bytes in all, got %d.", maxStopBytes, total)
	}
	return nil
}
