package reliability

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
)

// Process deaths: P or D runs as a child process (this test binary re-executed, see
// childMain) and is killed with SIGKILL at a chosen phase of a request; the other engine, the
// proxy and the fault proxies run in this process and are checked as survivors.

// killOptions describe a stack whose P or D is a child process.
type killOptions struct {
	childP        bool // P is the child (else D)
	policy        connector.FailurePolicy
	multiTurn     bool
	sideProxy     bool
	transferProxy bool
	pRestartable  bool // P (in process) keeps its engine_id and side-channel port across restarts
	tp            int  // both engines' --tensor-parallel-size (default 1)
	dTP           int  // D's, when it differs from P's (0: tp)
}

// killStack is P and D, one of them a child process, behind a proxy.
type killStack struct {
	p, d         *engine // the in-process one is set
	pc, dc       *child  // the child one is set
	httpP, httpD *faultproxy.Proxy
	side, xfer   *faultproxy.Proxy
	px           *runningProxy
	ref          *reference
	hc           *http.Client
	policy       connector.FailurePolicy
}

func startKillStack(t *testing.T, o killOptions) *killStack {
	t.Helper()
	k := &killStack{hc: client(t), ref: startReference(t), policy: o.policy}
	var backends []string
	if o.transferProxy {
		backends = []string{"TCP"}
		k.xfer = newFaultProxy(t, "")
	}
	var pURL, pSide, pTransfer, dURL string
	dTP := cmp.Or(o.dTP, o.tp)
	if o.childP {
		spec := childSpec{Role: connector.RoleProducer, Backends: backends, TP: o.tp}
		if k.xfer != nil {
			spec.AdvertiseTCP = k.xfer.Addr()
		}
		k.pc = startChild(t, "P", spec)
		pURL, pSide, pTransfer = k.pc.URL, k.pc.side, k.pc.transfer
		k.d = startEngine(t, "D", engineOptions{role: connector.RoleConsumer, policy: o.policy, backends: backends, prefix: true, tp: dTP})
		dURL = k.d.URL
	} else {
		po := engineOptions{role: connector.RoleProducer, backends: backends, clock: newFakeClock(), tp: o.tp}
		if o.pRestartable {
			po.engineID, po.keepSidePort = "prefill-0", true
		}
		if k.xfer != nil {
			po.advertiseTCP = k.xfer.Addr()
		}
		k.p = startEngine(t, "P", po)
		pURL, pSide, pTransfer = k.p.URL, k.p.Connector.SideChannelAddr(), k.p.transferAddr()
		k.dc = startChild(t, "D", childSpec{Role: connector.RoleConsumer, Policy: o.policy, Backends: backends, TP: dTP})
		dURL = k.dc.URL
	}
	if k.xfer != nil {
		k.xfer.SetTarget(pTransfer)
	}
	k.httpP = newFaultProxy(t, hostPort(pURL))
	k.httpD = newFaultProxy(t, hostPort(dURL))
	po := proxyOptions{multiTurn: o.multiTurn}
	if o.sideProxy {
		k.side = newFaultProxy(t, pSide)
		var port int
		fmt.Sscanf(pSide[strings.LastIndexByte(pSide, ':')+1:], "%d", &port)
		po.rewrite = map[int]int{port: k.side.Port()}
	}
	k.px = startProxy(t, k.httpP.URL(), k.httpD.URL(), po)
	return k
}

// restartP restarts the in-process P (see killOptions.pRestartable) behind its fault proxy.
func (k *killStack) restartP(t *testing.T) {
	t.Helper()
	k.p.restart(t)
	k.httpP.SetTarget(hostPort(k.p.URL))
}

// askOK sends a completion through the proxy and checks it against the single engine.
func (k *killStack) askOK(t *testing.T, prompt string, seed int) {
	t.Helper()
	body := completion(prompt, 12, sampled(seed)...)
	r := post(t, k.hc, k.px.URL+"/v1/completions", "", body)
	if want := k.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
		t.Fatalf("P/D answer %d %q (%s); the single engine says %q", r.status, r.text, r.raw, want)
	}
}

// wantPolicyOutcome is stack.wantPolicyOutcome for a kill stack.
func (k *killStack) wantPolicyOutcome(t *testing.T, r reply, body map[string]any) {
	t.Helper()
	(&stack{opts: stackOptions{policy: k.policy}, ref: k.ref}).wantPolicyOutcome(t, r, body)
}

// async sends a request on its own goroutine; wait returns the reply (at most requestDeadline).
func async(t *testing.T, hc *http.Client, url, reqID string, body map[string]any) func() reply {
	done := make(chan reply, 1)
	errc := make(chan error, 1)
	go func() {
		r, err := tryPost(t.Context(), hc, url, reqID, body)
		if err != nil {
			errc <- err
			return
		}
		done <- r
	}()
	return func() reply {
		t.Helper()
		select {
		case r := <-done:
			return r
		case err := <-errc:
			t.Fatalf("request: %v", err)
		case <-time.After(requestDeadline + time.Second):
			t.Fatal("no answer within the request deadline")
		}
		return reply{}
	}
}

// TestProducerKilledBeforeHandshake: P answers the prefill and dies before D contacts it (the
// proxy kills it just before the decode leg leaves). D's handshake fails at once: 500 under
// fail, the right answer under recompute; counted on D; D's pool full.
func TestProducerKilledBeforeHandshake(t *testing.T) {
	t.Parallel()
	policies(t, func(t *testing.T, policy connector.FailurePolicy) {
		leakCheck(t)
		k := startKillStack(t, killOptions{childP: true, policy: policy})
		k.px.beforeLeg(func(host string) {
			if host == k.httpD.Addr() {
				if err := k.pc.kill(); err != nil {
					t.Error(err)
				}
			}
		})
		body := completion(longPrompt(40), 12, sampled(40)...)
		r := post(t, k.hc, k.px.URL+"/v1/completions", "", body)
		k.wantPolicyOutcome(t, r, body)
		waitMetric(t, k.hc, k.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
		k.d.waitPoolFull(t)
	})
}

// TestProducerKilledDuringRead: D's READ request is held on its way to P (the transfer path
// is TCP through a fault proxy); P is killed while D waits for the data. The end of P's
// connections reaches D, whose READ fails at once (not at the 60 s load deadline): 500 under
// fail, the right answer under recompute; counted; D's pool full.
func TestProducerKilledDuringRead(t *testing.T) {
	t.Parallel()
	policies(t, func(t *testing.T, policy connector.FailurePolicy) { producerKilledDuringRead(t, policy, 1, 1) })
}

// producerKilledDuringRead is TestProducerKilledDuringRead with P at TP pTP and D at TP dTP.
func producerKilledDuringRead(t *testing.T, policy connector.FailurePolicy, pTP, dTP int) {
	leakCheck(t)
	k := startKillStack(t, killOptions{childP: true, policy: policy, transferProxy: true, tp: pTP, dTP: dTP})
	if got := k.d.Pool.TensorParallelSize(); got != dTP {
		t.Fatalf("D runs %d ranks, want %d", got, dTP)
	}
	k.askOK(t, longPrompt(41), 41) // handshake and transfer connections
	before := k.d.Connector.Agent().Stats()
	held := k.xfer.Stall(faultproxy.Up)
	body := completion(longPrompt(42), 12, sampled(42)...)
	wait := async(t, k.hc, k.px.URL+"/v1/completions", "", body)
	// D's READ is posted (its agent counts it in flight) and cannot reach P: the stall holds
	// what D sends.
	fired(t, "the transfer path towards P to hold D's bytes", held)
	eventually(t, "D's READ to be in flight", func() bool { return k.d.Connector.Agent().Stats().InflightRequests > 0 })
	k.pc.mustKill(t)
	r := wait()
	k.wantPolicyOutcome(t, r, body)
	if after := k.d.Connector.Agent().Stats(); after.Failures.Total() == before.Failures.Total() {
		t.Errorf("D's transfer agent counted no failure: %+v", after.Failures)
	}
	waitMetric(t, k.hc, k.d.URL, "vllm:nixl_num_failed_transfers_total", 1)
	k.d.waitPoolFull(t)
}

// notification matches the read notification D sends P for a request whose X-Request-Id is
// id: "<P's request id>:1", P's request id containing id.
func notification(id string) *regexp.Regexp {
	return regexp.MustCompile(regexp.QuoteMeta(id) + `[^,:\x00]*:1`)
}

// TestProducerKilledAfterReadBeforeNotification: D read everything, its notification to P is
// held, and P dies. D does not depend on P any more: the right answer, nothing counted, D's
// pool full.
func TestProducerKilledAfterReadBeforeNotification(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{childP: true, policy: connector.PolicyFail, transferProxy: true})
	k.askOK(t, longPrompt(43), 43)
	const id = "rel-p-after-read"
	held := k.xfer.StallOnMatch(faultproxy.Up, notification(id))
	body := completion(longPrompt(44), 12, sampled(44)...)
	wait := async(t, k.hc, k.px.URL+"/v1/completions", id, body)
	fired(t, "D's notification to be held", held)
	k.pc.mustKill(t)
	r := wait()
	if want := k.ref.answer(t, "/v1/completions", body); r.status != 200 || r.text != want {
		t.Fatalf("%d %q %s; want 200 %q", r.status, r.text, r.raw, want)
	}
	if n := metric(t, k.hc, k.d.URL, "vllm:nixl_num_failed_transfers_total"); n != 0 {
		t.Errorf("D counted %v failed transfers", n)
	}
	k.d.waitPoolFull(t)
}

// stream sends a streaming request and calls onFirst once, when the first content event
// arrives; it returns what the client saw and the error that ended the body, if any.
func stream(t *testing.T, hc *http.Client, url string, body map[string]any, onFirst func()) (reply, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), requestDeadline)
	defer cancel()
	a, err := apiclient.PostWatching(ctx, hc, url, withBody(body, "stream", true), nil, func(r apiclient.Reply) {
		if r.Chunks == 1 {
			onFirst()
		}
	})
	if err != nil && a.Status == 0 {
		t.Fatalf("stream: %v", err)
	}
	return replyOf(a), err
}

// TestProducerKilledWhileDecodeStreams: D has P's KV and is streaming when P dies: the stream
// goes on to the right, complete answer; D's pool full.
func TestProducerKilledWhileDecodeStreams(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{childP: true, policy: connector.PolicyFail})
	body := completion(longPrompt(45), 200, append(sampled(45), "ignore_eos", true)...)
	r, err := stream(t, k.hc, k.px.URL+"/v1/completions", body, func() { k.pc.mustKill(t) })
	if err != nil {
		t.Fatalf("the stream broke: %v", err)
	}
	want := k.ref.answer(t, "/v1/completions", body)
	if r.status != 200 || r.err != nil || r.text != want || !strings.HasSuffix(strings.TrimSpace(r.raw), "data: [DONE]") {
		t.Fatalf("%d, error %v, text %q; want 200 %q ending with [DONE]", r.status, r.err, r.text, want)
	}
	k.d.waitPoolFull(t)
}

// TestDecoderKilledBeforeHandshake: D received the request and is waiting for P's side channel
// (its handshake request is held) when it dies. The proxy answers 502 decode_request_failed;
// P's blocks, held for a reader that is gone, return when the lease expires (counted).
func TestDecoderKilledBeforeHandshake(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{sideProxy: true})
	held := k.side.Stall(faultproxy.Up)
	wait := async(t, k.hc, k.px.URL+"/v1/completions", "", completion(longPrompt(46), 12, sampled(46)...))
	fired(t, "D's handshake request to be held", held)
	k.dc.mustKill(t)
	wantError(t, wait(), 502, "decode_request_failed")
	k.expireP(t)
}

// expireP expires P's leases (P in process, on a fake clock) once P holds a finished
// request's blocks, and waits for its pool to be full and the expiry to be counted.
func (k *killStack) expireP(t *testing.T) {
	t.Helper()
	eventually(t, "P to hold the finished prefill's blocks", func() bool { return k.p.Engine.Stats().Delayed >= 1 })
	k.p.clock.advance(t, 31*time.Second)
	k.p.waitPoolFull(t)
	waitMetric(t, k.hc, k.p.URL, "vllm:nixl_num_kv_expired_reqs_total", 1)
}

// TestDecoderKilledDuringRead: P's READ data is held on its way to D and D dies: 502
// decode_request_failed; P's lease frees the blocks.
func TestDecoderKilledDuringRead(t *testing.T) {
	t.Parallel()
	decoderKilledDuringRead(t, 1, 1)
}

// decoderKilledDuringRead is TestDecoderKilledDuringRead with both engines at TP tp.
func decoderKilledDuringRead(t *testing.T, pTP, dTP int) {
	leakCheck(t)
	k := startKillStack(t, killOptions{transferProxy: true, tp: pTP, dTP: dTP})
	if got := k.p.Pool.TensorParallelSize(); got != pTP {
		t.Fatalf("P runs %d ranks, want %d", got, pTP)
	}
	k.askOK(t, longPrompt(47), 47)
	held := k.xfer.Stall(faultproxy.Down)
	wait := async(t, k.hc, k.px.URL+"/v1/completions", "", completion(longPrompt(48), 12, sampled(48)...))
	fired(t, "P's READ data to be held", held)
	k.dc.mustKill(t)
	wantError(t, wait(), 502, "decode_request_failed")
	k.expireP(t)
}

// TestDecoderKilledAfterReadBeforeNotification: D read P's blocks, its notification is held,
// and D dies while decoding: 502 decode_request_failed; P never hears of the read and its
// lease frees the blocks.
func TestDecoderKilledAfterReadBeforeNotification(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{transferProxy: true})
	k.askOK(t, longPrompt(49), 49)
	const id = "rel-d-after-read"
	held := k.xfer.StallOnMatch(faultproxy.Up, notification(id))
	wait := async(t, k.hc, k.px.URL+"/v1/completions", id, completion(longPrompt(50), 1500, "ignore_eos", true))
	fired(t, "D's notification to be held", held)
	k.dc.mustKill(t)
	wantError(t, wait(), 502, "decode_request_failed")
	k.expireP(t)
}

// TestDecoderKilledWhileStreaming: D dies in the middle of its stream. The multi-turn proxy
// ends the client's stream with an SSE error event and [DONE]; P was notified by D's read
// and its pool is full.
func TestDecoderKilledWhileStreaming(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	k := startKillStack(t, killOptions{multiTurn: true})
	body := completion(longPrompt(51), 1500, "ignore_eos", true)
	r, err := stream(t, k.hc, k.px.URL+"/v1/completions", body, func() { k.dc.mustKill(t) })
	if err != nil {
		t.Fatalf("the stream broke instead of ending with an error event: %v", err)
	}
	if r.status != 200 || r.err == nil || !strings.Contains(fmt.Sprint(r.err["message"]), "decode stream ended early") ||
		!strings.HasSuffix(strings.TrimSpace(r.raw), "data: [DONE]") {
		t.Fatalf("%d %s; want 200 ending with an SSE error event and [DONE]", r.status, tail(r.raw, 300))
	}
	k.p.waitPoolFull(t)
}
