package model

import "errors"

// Sentinel errors of the model package; wrapped errors are checkable with errors.Is.
var (
	// ErrModelNotFound means the model argument named no built-in model, no local directory and
	// no snapshot in the local Hugging Face cache.
	ErrModelNotFound = errors.New("model: not found")
	// ErrBadConfig means config.json or generation_config.json is malformed or inconsistent.
	ErrBadConfig = errors.New("model: bad config")
	// ErrUnsupported means the checkpoint uses an architecture, dtype or feature not implemented here.
	ErrUnsupported = errors.New("model: unsupported")
	// ErrBadWeights means a safetensors file or index is malformed, or a tensor has the wrong shape.
	ErrBadWeights = errors.New("model: bad weights")
	// ErrMissingTensor means a tensor the architecture needs is absent from the checkpoint.
	ErrMissingTensor = errors.New("model: missing tensor")
	// ErrBadInput means a Forward call's sequences are inconsistent (token out of range, block
	// table too short, logits buffer of the wrong length).
	ErrBadInput = errors.New("model: bad forward input")
	// ErrTensorParallel means OpenOptions.TensorParallelSize or RankCPUs cannot be used: a size
	// the head counts do not allow, or a CPU set the ranks' threads cannot be pinned to.
	ErrTensorParallel = errors.New("model: tensor parallelism")
	// ErrClosed means the model was used after Close.
	ErrClosed = errors.New("model: closed")
)
