package engine

import "errors"

// Sentinel errors of the engine; returned errors wrap them, so test with errors.Is.
var (
	// ErrInvalidRequest reports a request the engine refuses: empty prompt, max_tokens ≤ 0,
	// min_tokens < 0 or above max_tokens, a token id outside the vocabulary, a duplicate id.
	ErrInvalidRequest = errors.New("engine: invalid request")
	// ErrPromptTooLong reports a prompt of at least MaxModelLen tokens (no room to generate). It
	// also matches ErrInvalidRequest.
	ErrPromptTooLong = errors.New("engine: prompt too long")
	// ErrConfig reports an invalid engine or scheduler configuration.
	ErrConfig = errors.New("engine: invalid configuration")
	// ErrClosed reports use of an engine after Close, and is the Err of outputs of requests that
	// were still live when the engine closed.
	ErrClosed = errors.New("engine: closed")
	// ErrAborted is the Err of the final output of a request whose context was cancelled.
	ErrAborted = errors.New("engine: request aborted")
	// ErrKVLoad is the Err of a request that failed because a KV load of its connector failed
	// (policy fail).
	ErrKVLoad = errors.New("engine: KV load failed")
	// ErrForward is the Err of requests whose model forward step failed.
	ErrForward = errors.New("engine: forward step failed")
)

// promptTooLongError matches both ErrPromptTooLong and ErrInvalidRequest.
type promptTooLongError struct{ msg string }

func (e *promptTooLongError) Error() string { return e.msg }

func (e *promptTooLongError) Is(target error) bool {
	return target == ErrPromptTooLong || target == ErrInvalidRequest
}
