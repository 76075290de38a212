package proxy

import (
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// A P/D request that ends without a KV transfer is served all the same (D computes the prompt
// itself, answer 200): the deployment silently stops being P/D. Both proxies count such requests
// by reason and warn, at most once per instance and reason per warnInterval, with the likely
// cause. The counts are in /healthcheck (requests_without_kv_transfer), and in the multi-turn
// proxy's /metrics (kvbridge:proxy_requests_without_kv_transfer_total{reason}), where
// `kvbridge check` reads them.

// The reasons a P/D request ended without a transfer.
const (
	// ReasonPrefillNoParams: P answered without kv_transfer_params.
	ReasonPrefillNoParams = "prefill_returned_no_params"
	// ReasonDecodePulledNothing: D's usage says it neither pulled nor found in its cache any of
	// the prompt (prompt_tokens_details.cached_tokens 0).
	ReasonDecodePulledNothing = "decode_pulled_nothing"
)

// warnInterval is how often a proxy repeats a warning about one instance and reason.
const warnInterval = time.Minute

// transferWatch counts and warns about P/D requests that ended without a transfer.
type transferWatch struct {
	log                     *slog.Logger
	noParams, pulledNothing atomic.Int64

	mu     sync.Mutex
	warned map[[2]string]time.Time // (reason, instance) → last warning
}

func newTransferWatch(log *slog.Logger) *transferWatch {
	return &transferWatch{log: log, warned: map[[2]string]time.Time{}}
}

// counts returns the counts by reason.
func (tw *transferWatch) counts() map[string]int64 {
	return map[string]int64{ReasonPrefillNoParams: tw.noParams.Load(), ReasonDecodePulledNothing: tw.pulledNothing.Load()}
}

// prefillWithoutParams counts a prefill leg that P answered without kv_transfer_params.
func (tw *transferWatch) prefillWithoutParams(p Instance, reqID string) {
	tw.noParams.Add(1)
	tw.warn(ReasonPrefillNoParams, p, reqID, "the prefill instance returned no kv_transfer_params, so the decode instance computes the whole prompt itself: "+
		"is the prefill instance a kv_producer (or kv_both) with --kv-transfer-config set — are P and D swapped?")
}

// decoded looks at D's usage, when D reported one with prompt_tokens_details (an engine
// started with --enable-prompt-tokens-details), and counts an answer for which D pulled nothing.
func (tw *transferWatch) decoded(d Instance, reqID string, usage map[string]any) {
	details, ok := usage["prompt_tokens_details"].(map[string]any)
	if !ok {
		return
	}
	prompt, _ := jsonInt(usage["prompt_tokens"])
	cached, ok := jsonInt(details["cached_tokens"])
	if !ok || cached > 0 || prompt < 2 {
		return // D recomputes the last prompt token: a pull leaves at least one cached token
	}
	tw.pulledNothing.Add(1)
	tw.warn(ReasonDecodePulledNothing, d, reqID, "the decode instance pulled none of the prompt's KV from the prefill instance and computed it itself: "+
		"check the decode instance's log — likely causes: different auth tokens (KVBRIDGE_KV_AUTH_TOKEN), a failed handshake "+
		"(a different model or dtype), or a decode instance without --kv-transfer-config")
}

// warn logs msg about inst unless it was logged for the same instance and reason within
// warnInterval.
func (tw *transferWatch) warn(reason string, inst Instance, reqID, msg string) {
	now := time.Now()
	key := [2]string{reason, inst.String()}
	tw.mu.Lock()
	last, seen := tw.warned[key]
	if seen && now.Sub(last) < warnInterval {
		tw.mu.Unlock()
		return
	}
	tw.warned[key] = now
	tw.mu.Unlock()
	tw.log.Warn("P/D request served without a KV transfer: "+msg, "reason", reason, "instance", inst.String(), "request_id", reqID,
		"count", tw.counts()[reason])
}

// jsonInt reads a JSON number decoded as json.Number or float64.
func jsonInt(v any) (int64, bool) {
	switch x := v.(type) {
	case json.Number:
		n, err := x.Int64()
		return n, err == nil
	case float64:
		return int64(x), true
	}
	return 0, false
}

// watchTransfer counts a prefill leg that returned no params and returns nil; otherwise it
// returns what checks D's usage (decodeOptions.sawUsage).
func (l *legs) watchTransfer(p, d Instance, reqID string, pre prefillResult) func(map[string]any) {
	if pre.params == nil {
		l.watch.prefillWithoutParams(p, reqID)
		return nil
	}
	return l.watchDecode(d, reqID)
}

// watchDecode returns what checks D's usage in the concurrent push flow, where P's params are
// not waited for (P's answer without params is counted when it comes).
func (l *legs) watchDecode(d Instance, reqID string) func(map[string]any) {
	return func(u map[string]any) { l.watch.decoded(d, reqID, u) }
}

// withTransferCounts adds to a health body the counts of requests served without a transfer
// and of clients stalled past the write timeout.
func (l *legs) withTransferCounts(fields map[string]any) map[string]any {
	fields["requests_without_kv_transfer"] = l.watch.counts()
	fields["clients_stalled"] = l.stalled.Load()
	return fields
}
