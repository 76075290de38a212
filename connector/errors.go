package connector

import "errors"

// The connector's errors, checkable with errors.Is; the side channel's, ErrHandshake and
// ErrIncompatible, are in sidechannel.go.
var (
	// ErrConfig reports an invalid --kv-transfer-config; the message names the offending key.
	ErrConfig = errors.New("invalid --kv-transfer-config")

	// ErrParams reports kv_transfer_params of the wrong shape; the message names the field.
	ErrParams = errors.New("invalid kv_transfer_params")

	// ErrWrongRole reports a request whose kv_transfer_params ask this engine for a leg its kv_role
	// cannot serve. The HTTP layer refuses such a request before the engine takes it.
	ErrWrongRole = errors.New("kv_transfer_params ask for a leg this engine's kv_role does not serve")

	// ErrAuth reports a side-channel connection refused for authentication, by either side.
	ErrAuth = errors.New("KV peer authentication failed")

	// ErrStaleProducer reports params that name a producer instance which has since restarted: the
	// blocks they name belong to someone else now.
	ErrStaleProducer = errors.New("the producer restarted since these kv_transfer_params were issued")

	// ErrExpired reports a bidirectional read declined because the decoder's blocks expire too soon.
	ErrExpired = errors.New("remote KV blocks expire too soon to be read")

	// ErrStaleBlocks reports a read of blocks that the producer freed and reused before the read
	// finished (its lease expired): the KV read is not the prompt's and must not be used.
	ErrStaleBlocks = errors.New("KV blocks were reused by the producer before they were read")

	// ErrVerification reports remote blocks that do not hold what their owner published for the
	// reader's prompt: the owner's lease slot does not hold the tag of the params the reader was
	// given, or a block's record (generation, token count, content hash) does not match the
	// reader's own prompt at that position. The KV read is not used.
	ErrVerification = errors.New("remote KV blocks do not match what their owner published for this prompt")
)
