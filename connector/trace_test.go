package connector

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/internal/kvlease"
	"github.com/kvbridge/kvbridge/transfer"
)

// TestCoreTraces drives connector cores through the golden traces in testdata/core: each
// command is one event (or one scheduler step, whose hooks are events), and its output is what
// the core asked for, in actionsText's form, plus what the command reports. Cores sit behind
// real schedulers on one fake clock; the harness performs the scheduler's part of the actions
// (releases, finished and missed loads) as the Connector does, and nothing else: handshakes,
// loads and notifications end only when a command says so. Every hook is checked against the
// contract of actions (hookActions). Rewrite the expectations with
// `go test ./connector -run TestCoreTraces -rewrite`.
//
// Commands (on=NAME picks the core; the default is the last one created):
//
//	core name=P role=kv_producer [extra={...}]    a core named P (engine id P, instance iP,
//	     [engine=E] [policy=recompute]             host P-host:1; engine=E: engine id E;
//	     [vocab=N]                                 vocab: a push decoder asks for first tokens)
//	now 5s                                         the shared clock, from t0
//	add id=d1 prompt=8 [continues=X]               a request of 8 new tokens (after X's tokens:
//	    [max-tokens=1] [params=…] [edit=N]         a next turn; edit=N changes token N); params:
//	    [host=H]                                   none, template (P's), first-turn (D's), or the
//	                                               params request X finished with (X; as=prefill
//	                                               sends them to P, host=H rewrites remote_host)
//	step [n=1]                                     scheduler steps (each token sampled is 7)
//	tick                                           lease expiry, heartbeats, idle records
//	handshake-ended key=P/iP ok [inc=1]            or err=TEXT
//	load-finished id=d1 [err=KIND] [first-bad=N]   KIND: handshake (the one it awaited),
//	                                               disconnect, lease-gone, permission,
//	                                               verification, closed
//	deliver lease=p1 [forge]                       the last release sent for p1's lease (with a
//	                                               load or alone) reaches the core (forge:
//	                                               under another token)
//	heartbeat lease=p1 [extra]                     a heartbeat naming p1's lease token
//	notification msg=TEXT                          any notification
//	peer-lost peer=kvbridge-P inc=1
//	forget key=P/iP                                the worker forgets the current link of key
//	older key=P/iP                                 the handshaken records of other incarnations
//	evict blocks=N                                 the EvictHolds hook
//	decline params=X                               params of a request refused before the engine
//	state                                          remote records, leases, counts, free blocks
//
// Push mode (core … push: kv_connector NixlPushConnector):
//
//	add … params=push:X                            D's params of the serial flow, from X's
//	add … params=push-to:P [push-id=ID]            D's params naming core P, both legs at once
//	add … params=template push-id=ID               P's leg with a push_id
//	register id=d1 from=D on=P [peer=…] [inc=1]    D's last registration for d1 is sent (D
//	                                               records P's agent) and reaches P, from D's
//	                                               agent unless peer/inc say otherwise
//	push-ended id=p1 to=D [err=TEXT] [wrong-sender] P's write of p1 ended; its completion (or
//	    [from=AGENT] [token=T] [draws=N]           failure) reaches D, unless wrong-sender (from
//	    [other-fingerprint]                        AGENT instead of P's agent); token, draws and
//	                                               other-fingerprint forge its first token
//	deliver-notices to=D                           P's failure notices reach D
//	abort id=p1                                    the request is aborted (its client left)
func TestCoreTraces(t *testing.T) {
	datadriven.Walk(t, "testdata/core", func(t *testing.T, path string) {
		tr := &traceRun{t: t, cores: map[string]*coreHarness{}, params: map[string]map[string]any{},
			loads: map[string]loadJob{}, releases: map[string]string{}, tokens: map[string][]int32{},
			registers: map[string]registerJob{}, pushes: map[string]pushJob{}}
		datadriven.RunTest(t, path, tr.run)
	})
}

// traceRun is the state of one trace file.
type traceRun struct {
	t        *testing.T
	cores    map[string]*coreHarness
	last     string
	now      time.Duration
	params   map[string]map[string]any // by request id: the params it finished with, as they travel
	loads    map[string]loadJob        // by request id: its last load
	releases map[string]string         // by lease (the owner's request id): the last release sent for it
	tokens   map[string][]int32        // by request id: the tokens it finished with

	registers map[string]registerJob // by D's request id: its last registration
	pushes    map[string]pushJob     // by P's request id: its last push
	notices   []pushNotice           // P's failure notices not delivered yet
}

// run executes one command.
func (tr *traceRun) run(t *testing.T, d *datadriven.TestData) string {
	tr.t = t
	if d.Cmd == "core" {
		return tr.newCore(t, d)
	}
	h := tr.on(t, d)
	h.t = t
	var out strings.Builder
	switch d.Cmd {
	case "now":
		if len(d.CmdArgs) != 1 {
			d.Fatalf(t, "now takes one duration")
		}
		at, err := time.ParseDuration(d.CmdArgs[0].Key)
		if err != nil {
			d.Fatalf(t, "now: %v", err)
		}
		tr.now = at
		for _, c := range tr.cores {
			c.now = t0.Add(at)
		}
		return ""
	case "add":
		tr.add(t, d, h)
	case "step":
		n := 1
		if d.HasArg("n") {
			d.ScanArgs(t, "n", &n)
		}
		for range n {
			tr.step(t, h, &out)
		}
	case "tick":
		h.k.tick(h.now)
	case "handshake-ended":
		var key string
		d.ScanArgs(t, "key", &key)
		k := parseKey(t, d, key)
		if d.HasArg("ok") {
			inc := uint64(1)
			if d.HasArg("inc") {
				d.ScanArgs(t, "inc", &inc)
			}
			h.k.handshakeEnded(k, &remoteLink{key: k, id: k.engine, peer: "kvbridge-" + k.engine, peerInc: inc}, nil)
		} else {
			var msg string
			d.ScanArgs(t, "err", &msg)
			h.k.handshakeEnded(k, nil, fmt.Errorf("%w: %s", ErrHandshake, msg))
		}
	case "load-finished":
		tr.loadFinished(t, d, h)
	case "deliver":
		var id string
		d.ScanArgs(t, "lease", &id)
		msg, ok := tr.releases[id]
		if !ok {
			d.Fatalf(t, "nobody sent a release of %s", id)
		}
		if d.HasArg("forge") { // the same release under another token
			r, err := kvlease.ParseRelease(msg)
			if err != nil {
				d.Fatalf(t, "%v", err)
			}
			r.Token[0]++
			msg = kvlease.FormatRelease(r)
		}
		h.k.notification("kvbridge-D", msg, h.now)
	case "heartbeat":
		var id string
		d.ScanArgs(t, "lease", &id)
		tokens := []string{tr.paramsOf(t, d, id).Lease.String()}
		if d.HasArg("extra") {
			tokens = append(tokens, strings.Repeat("0", 32))
		}
		h.k.notification("kvbridge-D", kvlease.FormatHeartbeat(tokens), h.now)
	case "notification":
		var msg string
		d.ScanArgs(t, "msg", &msg)
		h.k.notification("kvbridge-D", msg, h.now)
	case "peer-lost":
		var peer string
		var inc uint64
		d.ScanArgs(t, "peer", &peer)
		d.ScanArgs(t, "inc", &inc)
		h.k.peerLost(peer, inc, h.now)
	case "forget":
		var key string
		d.ScanArgs(t, "key", &key)
		r := h.k.remotes[parseKey(t, d, key)]
		if r == nil || r.link == nil {
			d.Fatalf(t, "no handshaken record of %s", key)
		}
		h.k.forget(r.link)
	case "older":
		var key string
		d.ScanArgs(t, "key", &key)
		for _, l := range h.k.older(parseKey(t, d, key)) {
			fmt.Fprintf(&out, "older: %s (%s#%d)\n", l.key, l.peer, l.peerInc)
		}
		return out.String()
	case "evict":
		var blocks int
		d.ScanArgs(t, "blocks", &blocks)
		ids := coreAdapter{h}.EvictHolds(blocks)
		fmt.Fprintf(&out, "evicted: %v\n", ids)
	case "decline":
		var id string
		d.ScanArgs(t, "params", &id)
		h.k.decline(tr.params[id], h.now)
	case "state":
		return tr.state(h)
	case "abort":
		var id string
		d.ScanArgs(t, "id", &id)
		ev, ok := h.sched.Finish(id, engine.StatusFinishedAborted, h.now)
		if !ok {
			d.Fatalf(t, "%s is not live", id)
		}
		tr.finished(t, ev, &out)
	case "register":
		return tr.register(t, d, h)
	case "push-ended":
		return tr.pushEnded(t, d, h)
	case "deliver-notices":
		var to string
		d.ScanArgs(t, "to", &to)
		dh := tr.cores[to]
		for _, n := range tr.notices {
			dh.k.pushMessage("kvbridge-"+h.k.engineID, 1, string(n.msg), dh.now)
		}
		tr.notices = nil
		return labelled(to, tr.perform(t, dh))
	default:
		d.Fatalf(t, "unknown command %q", d.Cmd)
	}
	return tr.perform(t, h) + out.String()
}

// newCore creates the core the command names.
func (tr *traceRun) newCore(t *testing.T, d *datadriven.TestData) string {
	var name, role string
	d.ScanArgs(t, "name", &name)
	d.ScanArgs(t, "role", &role)
	engineID := name
	if d.HasArg("engine") {
		d.ScanArgs(t, "engine", &engineID)
	}
	extra := "{}"
	if d.HasArg("extra") {
		d.ScanArgs(t, "extra", &extra)
	}
	policy := "fail"
	if d.HasArg("policy") {
		d.ScanArgs(t, "policy", &policy)
	}
	connector := "NixlConnector"
	if d.HasArg("push") {
		connector = "NixlPushConnector"
	}
	h := newCoreHarness(t, `{"kv_connector":"`+connector+`","kv_role":"`+role+`","kv_load_failure_policy":"`+policy+`","kv_connector_extra_config":`+extra+`}`)
	h.k.engineID, h.k.instance, h.k.host, h.k.port = engineID, "i"+name, name+"-host", 1
	if d.HasArg("vocab") {
		d.ScanArgs(t, "vocab", &h.k.vocab)
	}
	h.now = t0.Add(tr.now)
	tr.cores[name], tr.last = h, name
	return ""
}

// on returns the core the command names (on=NAME), or the last one created.
func (tr *traceRun) on(t *testing.T, d *datadriven.TestData) *coreHarness {
	name := tr.last
	if d.HasArg("on") {
		d.ScanArgs(t, "on", &name)
	}
	h := tr.cores[name]
	if h == nil {
		d.Fatalf(t, "no core %q", name)
	}
	return h
}

// parseKey parses ENGINE/INSTANCE.
func parseKey(t *testing.T, d *datadriven.TestData, s string) remoteKey {
	e, i, ok := strings.Cut(s, "/")
	if !ok {
		d.Fatalf(t, "key %q is not ENGINE/INSTANCE", s)
	}
	return remoteKey{e, i}
}

// paramsOf parses the params request id finished with.
func (tr *traceRun) paramsOf(t *testing.T, d *datadriven.TestData, id string) *Params {
	p, err := ParseParams(tr.params[id])
	if err != nil || p == nil {
		d.Fatalf(t, "no params of request %s: %v", id, err)
	}
	return p
}

// add adds a request to the core's scheduler; its Arrived hook runs.
func (tr *traceRun) add(t *testing.T, d *datadriven.TestData, h *coreHarness) {
	var id, from string
	var prompt int
	maxTokens := 1
	d.ScanArgs(t, "id", &id)
	d.ScanArgs(t, "prompt", &prompt)
	if d.HasArg("max-tokens") {
		d.ScanArgs(t, "max-tokens", &maxTokens)
	}
	if d.HasArg("params") {
		d.ScanArgs(t, "params", &from)
	}
	var kv map[string]any
	switch from {
	case "", "none":
	case "template":
		kv = template()
	case "first-turn":
		kv = map[string]any{"do_remote_prefill": true}
	default:
		if x, ok := strings.CutPrefix(from, "push:"); ok {
			p := tr.paramsOf(t, d, x)
			kv = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": p.RemoteEngineID,
				"remote_request_id": p.RemoteRequestID, "remote_host": p.RemoteHost, "remote_port": float64(p.RemotePort), "tp_size": float64(1)}
			break
		}
		if name, ok := strings.CutPrefix(from, "push-to:"); ok {
			kv = map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": name,
				"remote_host": name + "-host", "remote_port": float64(1), "tp_size": float64(1)}
			break
		}
		kv = viaJSON(t, tr.paramsOf(t, d, from).Map())
		if d.HasArg("as") { // the multi-turn proxy sends D's params to P as a prefill's
			kv["do_remote_decode"], kv["do_remote_prefill"] = true, false
		}
		if d.HasArg("host") { // a proxy rewrote remote_host
			var host string
			d.ScanArgs(t, "host", &host)
			kv["remote_host"] = host
		}
	}
	if d.HasArg("push-id") {
		var pid string
		d.ScanArgs(t, "push-id", &pid)
		kv["push_id"] = pid
	}
	tokens := ids(int32(prompt))
	if d.HasArg("continues") {
		var prev string
		d.ScanArgs(t, "continues", &prev)
		tokens = append(slices.Clone(tr.tokens[prev]), tokens...)
	}
	if d.HasArg("edit") {
		var at int
		d.ScanArgs(t, "edit", &at)
		tokens[at]++
	}
	if _, err := h.sched.Add(&engine.Request{ID: id, Prompt: tokens, MaxTokens: maxTokens, KVTransfer: kv}, h.now); err != nil {
		d.Fatalf(t, "add %s: %v", id, err)
	}
}

// step runs one scheduler step, reporting the requests it finished and their params.
func (tr *traceRun) step(t *testing.T, h *coreHarness, out *strings.Builder) {
	plan := h.sched.Schedule(h.now)
	sampled := make([]int32, len(plan.Work))
	for i := range sampled {
		sampled[i] = 7
	}
	for _, ev := range h.sched.Update(h.now, sampled) {
		tr.finished(t, ev, out)
	}
}

// finished reports a finished request and keeps its params.
func (tr *traceRun) finished(t *testing.T, ev engine.Event, out *strings.Builder) {
	if !ev.Seq.Status().Finished() {
		return
	}
	tr.tokens[ev.Seq.ID()] = slices.Clone(ev.Seq.Tokens())
	fmt.Fprintf(out, "finished: %s %s", ev.Seq.ID(), ev.Seq.Status())
	if ev.KVTransfer == nil {
		out.WriteString("\n")
		return
	}
	raw := viaJSON(t, ev.KVTransfer)
	tr.params[ev.Seq.ID()] = raw
	p, err := ParseParams(raw)
	if err != nil {
		t.Fatalf("the params %s finished with: %v", ev.Seq.ID(), err)
	}
	leg := "do_remote_prefill"
	if p.DoRemoteDecode {
		leg = "do_remote_decode"
	}
	fmt.Fprintf(out, ", params: %s from %s/%s blocks %v tokens %d lease %s slot %d", leg, p.RemoteEngineID, p.Instance,
		p.Blocks(), p.RemoteNumTokens, shortToken(p.Lease), p.LeaseSlot)
	if p.RemoteBlocksExpiryTime != nil {
		fmt.Fprintf(out, " expires %gs", *p.RemoteBlocksExpiryTime)
	}
	out.WriteString("\n")
}

// loadFinished hands the core the end of the request's last load.
func (tr *traceRun) loadFinished(t *testing.T, d *datadriven.TestData, h *coreHarness) {
	var id, kind string
	d.ScanArgs(t, "id", &id)
	j, ok := tr.loads[id]
	if !ok {
		d.Fatalf(t, "request %s started no load", id)
	}
	firstBad := 0
	if d.HasArg("first-bad") {
		d.ScanArgs(t, "first-bad", &firstBad)
	}
	if d.HasArg("err") {
		d.ScanArgs(t, "err", &kind)
	}
	errs := map[string]error{
		"":             nil,
		"disconnect":   transfer.ErrRemoteDisconnect,
		"lease-gone":   fmt.Errorf("%w: the lease's slot is clear", errLeaseGone),
		"permission":   transfer.ErrPermission,
		"verification": ErrVerification,
		"closed":       transfer.ErrClosed,
		"handshake":    j.handshakeErr,
	}
	err, ok := errs[kind]
	if kind == "handshake" && err == nil {
		err = fmt.Errorf("%w: the handshake the load awaited failed", ErrHandshake)
	}
	if !ok {
		d.Fatalf(t, "unknown load error %q", kind)
	}
	h.k.loadFinished(j, firstBad, err, errors.Is(err, transfer.ErrClosed), h.now)
}

// perform takes what the core asked for, renders it, and carries out the scheduler's part as
// the Connector does; that may run hooks, whose actions follow.
func (tr *traceRun) perform(t *testing.T, h *coreHarness) string {
	var out strings.Builder
	for range 10 {
		a := h.takeActs()
		text := actionsText(t, a)
		if text == "" {
			return out.String()
		}
		out.WriteString(text)
		for _, j := range a.loads {
			tr.loads[j.id], tr.releases[j.params.RemoteRequestID] = j, string(j.release)
		}
		for _, n := range a.notifies {
			tr.releases[n.params.RemoteRequestID] = string(n.msg)
		}
		for _, j := range a.registers {
			tr.registers[j.id] = j
		}
		for _, j := range a.pushes {
			tr.pushes[j.id] = j
		}
		tr.notices = append(tr.notices, a.pushNotices...)
		for _, id := range a.release {
			h.sched.ReleaseDelayed(id)
		}
		if len(a.loaded) > 0 || len(a.failed) > 0 {
			for _, ev := range h.sched.LoadsDone(h.now, a.loaded, a.first, a.failed) {
				tr.finished(t, ev, &out)
			}
		}
		if len(a.missed) > 0 {
			h.sched.LoadsMissed(a.missed)
		}
	}
	t.Fatal("the scheduler's part of the actions kept asking for more")
	return ""
}

// state renders the core's remote records, leases, heartbeats, counts and free blocks.
func (tr *traceRun) state(h *coreHarness) string {
	var b strings.Builder
	for _, r := range h.k.records() {
		status := "handshaking"
		if r.handshaken() {
			status = fmt.Sprintf("handshaken %s#%d", r.peer, r.peerInc)
		}
		fmt.Fprintf(&b, "remote: %s at %s %s, used %v\n", r.key, r.addr, status, r.lastUsed.Sub(t0))
	}
	for _, l := range h.k.leases.Leases() {
		kind := "lease"
		if !l.Renewable {
			kind = "hold"
		}
		fmt.Fprintf(&b, "%s: %s slot %d blocks %v until %v\n", kind, l.RequestID, l.Slot, l.Blocks, l.Deadline.Sub(t0))
	}
	fmt.Fprintf(&b, "heartbeats: %d leases tracked\n", h.k.heartbeats.Len())
	c := h.k.counts
	fmt.Fprintf(&b, "refused: params %d (mac %d), notifications %d, verification %d; hints cut %d; holds evicted %d\n",
		c.params.Load(), c.paramsMAC.Load(), c.notifications.Load(), c.verification.Load(), c.rejections.Load(), c.evictedHolds.Load())
	mfs, err := h.reg.Prometheus().Gather()
	if err != nil {
		tr.t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			if v := m.GetCounter().GetValue(); v != 0 && (strings.HasPrefix(name, "vllm:") || strings.HasPrefix(name, "kvbridge:")) {
				fmt.Fprintf(&b, "metric: %s %g\n", name, v)
			}
		}
	}
	fmt.Fprintf(&b, "blocks free: %d of %d\n", h.pool.NumFree(), h.pool.NumBlocks())
	return b.String()
}

// labelled prefixes each line of text with "name> " (what another core than the command's did).
func labelled(name, text string) string {
	var b strings.Builder
	for line := range strings.Lines(text) {
		b.WriteString(name + "> " + line)
	}
	return b.String()
}

// register sends D's last registration for a request: D records P's agent (as the worker does
// once the handshake is done), then the registration reaches P.
func (tr *traceRun) register(t *testing.T, d *datadriven.TestData, h *coreHarness) string {
	var id, from string
	d.ScanArgs(t, "id", &id)
	d.ScanArgs(t, "from", &from)
	j, ok := tr.registers[id]
	dh := tr.cores[from]
	if !ok || dh == nil {
		d.Fatalf(t, "core %s sent no registration for %s", from, id)
	}
	peer, inc := "kvbridge-"+dh.k.engineID, uint64(1)
	if d.HasArg("peer") {
		d.ScanArgs(t, "peer", &peer)
	}
	if d.HasArg("inc") {
		d.ScanArgs(t, "inc", &inc)
	}
	var out strings.Builder
	if !j.cancel && !dh.k.pushRegistered(j.id, j.nonce, "kvbridge-"+h.k.engineID, 1) {
		out.WriteString(labelled(from, "no longer waits: not sent\n"))
		return out.String()
	}
	out.WriteString(labelled(from, tr.perform(t, dh)))
	h.k.pushMessage(peer, inc, string(j.msg), h.now)
	return out.String() + tr.perform(t, h)
}

// pushEnded ends P's last push of a request and delivers its completion to D.
func (tr *traceRun) pushEnded(t *testing.T, d *datadriven.TestData, h *coreHarness) string {
	var id, to string
	d.ScanArgs(t, "id", &id)
	d.ScanArgs(t, "to", &to)
	j, ok := tr.pushes[id]
	dh := tr.cores[to]
	if !ok || dh == nil {
		d.Fatalf(t, "no push of %s towards %s", id, to)
	}
	wrong := d.HasArg("wrong-sender")
	h.k.pushEnded(id, wrong)
	out := tr.perform(t, h)
	if wrong {
		return out
	}
	var done pushCompletion
	if err := decodePush(strings.TrimPrefix(string(j.completion()), pushDonePrefix), &done); err != nil {
		t.Fatal(err)
	}
	if d.HasArg("err") {
		d.ScanArgs(t, "err", &done.Error)
	}
	if d.HasArg("token") {
		var tok int
		d.ScanArgs(t, "token", &tok)
		done.Token = &[]int32{int32(tok)}[0]
	}
	if d.HasArg("draws") {
		d.ScanArgs(t, "draws", &done.Draws)
	}
	if d.HasArg("other-fingerprint") {
		done.Fingerprint = bytes.Repeat([]byte{0xee}, 32)
	}
	from := "kvbridge-" + h.k.engineID
	if d.HasArg("from") {
		d.ScanArgs(t, "from", &from)
	}
	dh.k.pushMessage(from, 1, string(encodePush(pushDonePrefix, done)), dh.now)
	return out + labelled(to, tr.perform(t, dh))
}
