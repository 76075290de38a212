package engine

// Status is a request's state (vLLM's RequestStatus). A request starts WAITING; it may park in
// WAITING_FOR_REMOTE_KVS while its connector loads KV, runs while RUNNING (and goes back to
// WAITING when preempted), and ends in one of the four finished states.
type Status uint8

// Request states.
const (
	// StatusWaiting: queued for admission (new, preempted, or its remote KV arrived).
	StatusWaiting Status = iota
	// StatusWaitingForRemoteKVs: blocks allocated, the connector is loading KV into them.
	StatusWaitingForRemoteKVs
	// StatusRunning: admitted; scheduled every step while the token budget lasts.
	StatusRunning
	// StatusFinishedStopped: ended by EOS, a stop token id or a stop string.
	StatusFinishedStopped
	// StatusFinishedLengthCapped: ended by max_tokens or the model length.
	StatusFinishedLengthCapped
	// StatusFinishedAborted: aborted (client gone, engine closed).
	StatusFinishedAborted
	// StatusFinishedError: ended by an error (forward failure, KV load failure under policy fail).
	StatusFinishedError
)

// String returns vLLM's name of the state, such as "WAITING_FOR_REMOTE_KVS".
func (s Status) String() string {
	switch s {
	case StatusWaiting:
		return "WAITING"
	case StatusWaitingForRemoteKVs:
		return "WAITING_FOR_REMOTE_KVS"
	case StatusRunning:
		return "RUNNING"
	case StatusFinishedStopped:
		return "FINISHED_STOPPED"
	case StatusFinishedLengthCapped:
		return "FINISHED_LENGTH_CAPPED"
	case StatusFinishedAborted:
		return "FINISHED_ABORTED"
	case StatusFinishedError:
		return "FINISHED_ERROR"
	}
	return "UNKNOWN"
}

// Finished reports whether s is one of the finished states.
func (s Status) Finished() bool { return s >= StatusFinishedStopped }

// FinishReason returns the OpenAI finish_reason of a finished state (FinishStop, FinishLength,
// FinishAbort, FinishError) and "" for the others.
func (s Status) FinishReason() FinishReason {
	switch s {
	case StatusFinishedStopped:
		return FinishStop
	case StatusFinishedLengthCapped:
		return FinishLength
	case StatusFinishedAborted:
		return FinishAbort
	case StatusFinishedError:
		return FinishError
	}
	return ""
}
