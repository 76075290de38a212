package proxy

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/google/uuid"
)

// The push flows (TransferPush, TransferPushSerial; docs/architecture.md, "Push"). In both, D
// gets no remote_block_ids: it allocates blocks for the prompt, registers them with P over the
// transfer path, and P WRITEs the KV into them.
//
//   - Serial (vLLM's toy_push_proxy_server.py): P's leg exactly as pull's, then D's leg with
//     P's coordinates copied from P's params (serialPushParams).
//   - Concurrent (kvbridge's default for push, ai-dynamo/dynamo #13311's): the proxy knows P's
//     coordinates beforehand (P's GET /v1/kv_transfer, transfermode.go), draws a push_id, and
//     sends both legs at once: P the usual prefill leg plus the push_id, D the client's body with
//     P's coordinates and the push_id (pushDecodeParams). D's queueing, allocation and
//     registration overlap P's prefill. D's answer is relayed; P's (max_tokens=1) is awaited only
//     for its errors and usage (the handler returns once it came). P fails before D's answer
//     is whole: D's leg is cancelled (D aborts the request) and the client gets P's error — its
//     status when nothing was relayed yet, an error event ending the stream otherwise. D fails
//     or refuses (a 429): P's leg is cancelled (P aborts, or its lease expires) and the client
//     gets D's answer.

// pushID draws the id that ties a request's two legs together in the concurrent flow: random,
// never the client's X-Request-Id, so that no client can name another request's push.
func pushID() string { return uuid.NewString() }

// pushPrefillParams are P's params in the concurrent flow: the prefill template and the push_id.
func pushPrefillParams(template map[string]any, id string) map[string]any {
	template["push_id"] = id
	return template
}

// pushDecodeParams are D's params in the concurrent flow: P's coordinates and the push_id, no
// remote_request_id (D's registration names the push_id) and no remote_block_ids. host is where
// D reaches P's side channel.
func pushDecodeParams(info engineInfo, host, id string) map[string]any {
	tp := info.tpSize
	if tp <= 0 {
		tp = 1
	}
	return map[string]any{
		"do_remote_prefill": true,
		"do_remote_decode":  false,
		"remote_engine_id":  info.engineID,
		"remote_host":       host,
		"remote_port":       info.port,
		"tp_size":           tp,
		"push_id":           id,
	}
}

// serialPushParams are D's params in the serial flow, copied from P's answer as vLLM's toy push
// proxy copies them: P's coordinates, no remote_block_ids (nor anything else of P's). Without
// params from P, D gets none and prefills locally.
func serialPushParams(pre map[string]any) map[string]any {
	if pre == nil {
		return nil
	}
	out := map[string]any{"do_remote_prefill": true, "do_remote_decode": false}
	for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"} {
		out[k] = pre[k]
	}
	return out
}

// Causes of a push leg's cancellation.
var (
	// errPrefillFailed cancels D's leg: P's failed, so no KV will come.
	errPrefillFailed = errors.New("the prefill leg failed")
	// errDecodeEnded cancels P's leg: D's answer failed or was refused.
	errDecodeEnded = errors.New("the decode leg failed")
)

// prefillLeg is P's leg of the concurrent flow, run on a goroutine of its own; done is closed
// when res, err and end are set.
type prefillLeg struct {
	done chan struct{}
	res  prefillResult
	err  *legError
	end  time.Time
}

// answered reports P's outcome if P's leg has ended.
func (p *prefillLeg) answered() (prefillResult, bool) {
	select {
	case <-p.done:
		return p.res, p.err == nil
	default:
		return prefillResult{}, false
	}
}

// pushOutcome is how a concurrent push request ended.
type pushOutcome struct {
	pre       prefillResult // P's answer, when ok
	prefillOK bool          // P's leg succeeded (before D's answer ended, or while P's leg was awaited)
	prefilled time.Time     // when P's leg ended
	// prefillErr is P's failure, nil when P's leg succeeded or was cancelled (by the proxy, D's
	// answer having ended, or by the client leaving).
	prefillErr *legError
}

// responseTracker remembers the status of what went to the client, 0 while nothing did.
type responseTracker struct {
	http.ResponseWriter
	status int
}

func (t *responseTracker) WriteHeader(code int) {
	if t.status == 0 {
		t.status = code
	}
	t.ResponseWriter.WriteHeader(code)
}

func (t *responseTracker) Write(b []byte) (int, error) {
	if t.status == 0 {
		t.status = http.StatusOK
	}
	return t.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the writer's flush and deadlines.
func (t *responseTracker) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// push runs the concurrent flow: P's leg (pbody) on a goroutine of its own, D's leg (dbody)
// relayed on the caller's. It returns once both legs have ended. prefilled, if set, sees P's
// answer when P answered before the client's response headers go out.
func (l *legs) push(w http.ResponseWriter, r *http.Request, pInst, dInst Instance, path, reqID string, pbody, dbody body, o decodeOptions, prefilled func(http.Header, prefillResult)) pushOutcome {
	ctx := r.Context()
	pctx, pcancel := context.WithCancelCause(ctx)
	defer pcancel(nil)
	dctx, dcancel := context.WithCancelCause(ctx)
	defer dcancel(nil)
	leg := &prefillLeg{done: make(chan struct{})}
	go func() {
		defer close(leg.done)
		leg.res, leg.err = l.prefill(pctx, pInst, path, reqID, r.Header, pbody, false)
		leg.end = time.Now()
		if leg.err != nil {
			dcancel(errPrefillFailed) // no KV will come: D aborts the request
		}
	}()

	o.lazyHeader = true // a P that fails before D's first event is answered with P's status
	o.beforeHeader = func(h http.Header) {
		if res, ok := leg.answered(); ok && prefilled != nil {
			prefilled(h, res)
		}
	}
	tw := &responseTracker{ResponseWriter: w}
	derr := l.decode(tw, r.WithContext(dctx), dInst, path, reqID, dbody, o)

	prefillFailed := derr != nil && errors.Is(context.Cause(dctx), errPrefillFailed)
	if !prefillFailed && (derr != nil || tw.status/100 != 2) {
		pcancel(errDecodeEnded) // D failed or refused: nothing will collect P's KV
	}
	// Otherwise P's answer is awaited for its errors and usage (the client has D's whole
	// answer by now; it usually came first anyway, as D decodes once P wrote the KV).
	<-leg.done
	out := pushOutcome{pre: leg.res, prefillOK: leg.err == nil, prefilled: leg.end}
	if leg.err != nil && pctx.Err() == nil {
		out.prefillErr = leg.err
	}
	switch {
	case out.prefillErr != nil && out.prefillErr.body == nil:
		l.infos.forget(pInst) // P failed: ask for its coordinates again
	case leg.err == nil:
		l.infos.forgetUnless(pInst, engineIDOf(leg.res.params))
	}
	if (derr != nil || tw.status >= 500) && !prefillFailed && ctx.Err() == nil {
		l.infos.forget(pInst) // D failed: P's coordinates may be stale
	}
	if !prefillFailed || ctx.Err() != nil {
		return out
	}
	// P failed before D's answer ended: D's leg was cut without a word to the client.
	if tw.status == 0 {
		leg.err.write(tw)
	} else {
		writeSSEError(tw, "prefill leg failed: "+leg.err.message())
		_ = http.NewResponseController(tw).Flush()
	}
	return out
}

// engineIDOf returns the remote_engine_id of P's params, "" when absent.
func engineIDOf(params map[string]any) string {
	s, _ := params["remote_engine_id"].(string)
	return s
}
