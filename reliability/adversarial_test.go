package reliability

import (
	"encoding/hex"
	"fmt"
	"maps"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
)

// The adversarial suite: anyone who can reach an engine's or a proxy's HTTP port sends what
// they like, kv_transfer_params included. Each test is one finding of the attack probe
// (docs/reliability.md, "Threat model"), run against real engines, and asserts that the victims'
// answers are the single engine's, that the attacker gets nothing of anyone else's, and that
// the engines' pools come back.

// template is what a proxy asks P for on a first turn; an attacker can send it too.
func template() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

// prefillDirect asks P, directly, to prefill body's prompt for a remote decoder and returns the
// params P issues (which only P, D and a client talking to P directly ever see).
func prefillDirect(t *testing.T, s *stack, body map[string]any) map[string]any {
	t.Helper()
	r := post(t, s.hc, s.p.URL+"/v1/completions", "", withBody(body, "kv_transfer_params", template(), "max_tokens", 1))
	if r.status != 200 || r.kv == nil {
		t.Fatalf("prefill on P: %d %s", r.status, r.raw)
	}
	return r.kv
}

// promptIDs returns a completion body whose prompt is token ids (so that the test can hash
// them as the engines do).
func promptIDs(ids []int32, maxTokens int, extra ...any) map[string]any {
	b := map[string]any{"model": model.Tiny, "prompt": ids, "max_tokens": maxTokens, "temperature": 0}
	for i := 0; i+1 < len(extra); i += 2 {
		b[extra[i].(string)] = extra[i+1]
	}
	return b
}

// TestAttackPoisonDecoderCache: an attacker sends prompt X with the params P issued for prompt Y
// (obtained by sending Y to P directly). Through either proxy the params are refused (400);
// directly, D reads Y's blocks, finds that their records are not X's, and uses nothing (500
// under policy fail). D's prefix cache never holds Y's KV under X's hashes: the victim's
// requests for X, through the proxy and directly, get the single engine's answer. Both backends.
func TestAttackPoisonDecoderCache(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{policy: connector.PolicyFail, backends: []string{backend}, pClock: true})
			mt := startProxy(t, s.httpP.URL(), s.httpD.URL(), proxyOptions{multiTurn: true})
			x := completion(longPrompt(200), 12, sampled(200)...)
			forged := withBody(x, "kv_transfer_params", prefillDirect(t, s, completion(longPrompt(201), 12)))
			for _, px := range []string{s.px.URL, mt.URL} {
				if r := post(t, s.hc, px+"/v1/completions", "", forged); r.status != 400 || !strings.Contains(fmt.Sprint(r.err["message"]), "kv_transfer_params") {
					t.Errorf("X with Y's params through a proxy: %d %s, want 400", r.status, r.raw)
				}
			}
			if r := post(t, s.hc, s.d.URL+"/v1/completions", "", forged); r.status != 500 {
				t.Fatalf("X with Y's params straight to D: %d %s, want 500 (policy fail)", r.status, r.raw)
			}
			waitMetric(t, s.hc, s.d.URL, `kvbridge:kv_auth_refusals_total{kind="verification"}`, 1)
			want := s.ref.answer(t, "/v1/completions", x)
			for i, url := range []string{s.px.URL, mt.URL, s.d.URL} {
				if r := post(t, s.hc, url+"/v1/completions", "", x); r.status != 200 || r.text != want {
					t.Fatalf("the victim's X (%d): %d %q, the single engine says %q", i, r.status, r.text, want)
				}
			}
			// D's notification for X did not prove Y, the prompt of the lease it named: P keeps
			// that lease (Y's reader never comes) until kv_lease_duration passes.
			s.p.clock.advance(t, 31*time.Second)
			s.p.waitPoolFull(t)
			s.d.waitPoolFull(t)
		})
	}
}

// TestAttackPoisonPrefillerCache: with bidirectional transfer, an attacker takes D's params for
// prompt Y (sending Y to P and then to D directly, as a proxy would) and sends them to P with
// another prompt X, forging the hash hints to X's own chain (the hash function is public). P
// reads D's blocks, finds their records are not X's, and uses nothing; P's prefix cache never
// holds Y's KV for X, so the victim's X is answered right through the multi-turn proxy and on P.
func TestAttackPoisonPrefillerCache(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{bidirectional: true, policy: connector.PolicyFail, pPrefix: true})
	tok := s.ref.e.Model.Tokenizer()
	y := tok.Encode(longPrompt(210))
	pp := prefillDirect(t, s, promptIDs(y, 12))
	rd := post(t, s.hc, s.d.URL+"/v1/completions", "", promptIDs(y, 12, "kv_transfer_params", pp))
	if rd.status != 200 || rd.kv == nil {
		t.Fatalf("Y on D: %d %s", rd.status, rd.raw)
	}
	x := tok.Encode(longPrompt(211))
	forged := maps.Clone(rd.kv)
	forged["do_remote_decode"], forged["do_remote_prefill"] = true, false
	var hints []string
	for _, h := range kvcache.ChainHashes(x, blockSize) {
		hints = append(hints, h.String())
	}
	forged[connector.KeyBlockHashes] = hints
	if r := post(t, s.hc, s.p.URL+"/v1/completions", "", promptIDs(x, 1, "kv_transfer_params", forged)); r.status != 500 {
		t.Fatalf("X with D's params for Y straight to P: %d %s, want 500 (policy fail)", r.status, r.raw)
	}
	waitMetric(t, s.hc, s.p.URL, `kvbridge:kv_auth_refusals_total{kind="verification"}`, 1)
	victim := promptIDs(x, 12, sampled(211)...)
	want := s.ref.answer(t, "/v1/completions", victim)
	for i, url := range []string{s.px.URL, s.p.URL} {
		body := victim
		if i == 0 {
			body = withBody(victim, "conversation_id", "victim")
		}
		if r := post(t, s.hc, url+"/v1/completions", "", body); r.status != 200 || r.text != want {
			t.Fatalf("the victim's X (%d): %d %q, the single engine says %q", i, r.status, r.text, want)
		}
	}
}

// TestAttackReadAnotherRequest: a victim's prefill is held on P for its decoder. The attacker
// names the victim's blocks — with its own lease (from its own prefill), or with made-up ids
// and no lease at all, or one block eight times — and a prompt of its own. Over TCP P refuses
// the READ; over SHM the lease's tag does not cover those blocks; made-up params are refused
// before any read. The attacker only ever gets its own prompt's answer, and the victim's read
// afterwards succeeds. Both backends.
func TestAttackReadAnotherRequest(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{policy: connector.PolicyRecompute, backends: []string{backend}})
			victim := completion(longPrompt(220), 12, sampled(220)...)
			vp := prefillDirect(t, s, victim)
			mine := completion(longPrompt(221), 12, sampled(221)...)
			own := prefillDirect(t, s, mine)
			withLease := maps.Clone(own)
			for _, k := range []string{"remote_block_ids", "remote_num_tokens", connector.KeyBlockGenerations} {
				withLease[k] = vp[k]
			}
			withLease["remote_request_id"] = "made-up"
			bare := map[string]any{"do_remote_prefill": true, "remote_engine_id": vp["remote_engine_id"], "remote_request_id": "made-up",
				"remote_host": vp["remote_host"], "remote_port": vp["remote_port"], "remote_block_ids": vp["remote_block_ids"], "tp_size": 1}
			dup := maps.Clone(own)
			first := own["remote_block_ids"].([]any)[0].([]any)[0]
			dup["remote_block_ids"] = []any{[]any{first, first, first, first, first, first, first, first}}
			mineWant, victimWant := s.ref.answer(t, "/v1/completions", mine), s.ref.answer(t, "/v1/completions", victim)
			for name, kv := range map[string]map[string]any{"the attacker's lease": withLease, "no lease": bare, "one block eight times": dup} {
				r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(mine, "kv_transfer_params", kv))
				if r.status != 200 || r.text != mineWant || r.text == victimWant {
					t.Fatalf("%s: %d %q; the attacker's own answer is %q, the victim's %q", name, r.status, r.text, mineWant, victimWant)
				}
			}
			if r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(victim, "kv_transfer_params", vp)); r.status != 200 || r.text != victimWant {
				t.Fatalf("the victim's read: %d %q, want %q", r.status, r.text, victimWant)
			}
			if got := metric(t, s.hc, s.d.URL, `kvbridge:kv_auth_refusals_total{kind="params"}`); got < 2 {
				t.Errorf("D refused %v params, want at least 2 (no lease, duplicated ids)", got)
			}
			s.d.waitPoolFull(t)
		})
	}
}

// TestAttackFloodDecoderHolds: one client sends many one-token turns through the multi-turn
// proxy, each with a new conversation id, so that D holds every turn's blocks for the next one
// (decoder_kv_blocks_ttl, 480 s). Those holds are a cache: when D's pool is full the oldest are
// evicted (counted), and the other clients' requests keep being answered right, within the
// request deadline, while the flood goes on — they used to wait for the TTL.
func TestAttackFloodDecoderHolds(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{bidirectional: true, policy: connector.PolicyFail, dNumBlocks: 64})
	var flooded atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			body := withBody(completion(longPrompt(1000+i), 1), "conversation_id", fmt.Sprintf("flood-%d", i))
			if r, err := tryPost(t.Context(), s.hc, s.px.URL+"/v1/completions", "", body); err != nil || r.status != 200 {
				t.Errorf("flood turn %d: %v %d %s", i, err, r.status, r.raw)
				return
			}
			flooded.Add(1)
		}
	})
	eventually(t, "the flood to fill D's pool", func() bool { return metric(t, s.hc, s.d.URL, "kvbridge:kv_decoder_holds_evicted_total") > 0 })
	var worst time.Duration
	for i := range 8 {
		c := &conversation{id: fmt.Sprintf("legit-%d", i), seed: 300 + i}
		r := c.turn(t, s, longPrompt(300+i), "miss")
		worst = max(worst, r.elapsed)
	}
	close(stop)
	wg.Wait()
	t.Logf("during a flood of %d one-token turns that kept D's pool full, 8 other requests were answered right; the slowest in %v",
		flooded.Load(), worst.Round(time.Millisecond))
}

// TestAttackProducerRestartsReleaseMemory: P is killed with SIGKILL and restarted five times,
// with the same engine_id. D maps each incarnation's arena while it is alive and unmaps it once
// its death is observed: D's mapped memory never grows past one arena, and returns to zero
// after the last kill.
func TestAttackProducerRestartsReleaseMemory(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	hc, ref := client(t), startReference(t)
	d := startEngine(t, "D", engineOptions{role: connector.RoleConsumer, policy: connector.PolicyFail, prefix: true})
	httpP, httpD := newFaultProxy(t, ""), newFaultProxy(t, hostPort(d.URL))
	px := startProxy(t, httpP.URL(), httpD.URL(), proxyOptions{})
	var arena int64
	for i := range 6 {
		pc := startChild(t, fmt.Sprintf("P%d", i), childSpec{Role: connector.RoleProducer, EngineID: "prefill-0"})
		httpP.SetTarget(hostPort(pc.URL))
		body := completion(longPrompt(400+i), 12, sampled(400+i)...)
		if r := post(t, hc, px.URL+"/v1/completions", "", body); r.status != 200 || r.text != ref.answer(t, "/v1/completions", body) {
			t.Fatalf("incarnation %d: %d %s", i, r.status, r.raw)
		}
		mapped := d.Connector.Agent().Stats().MappedBytes
		if i == 0 {
			arena = mapped
		}
		if mapped <= 0 || mapped != arena {
			t.Fatalf("incarnation %d: D maps %d bytes, one arena is %d", i, mapped, arena)
		}
		pc.mustKill(t)
	}
	eventually(t, "D to unmap the last dead P's arena", func() bool { return d.Connector.Agent().Stats().MappedBytes == 0 })
	d.waitPoolFull(t)
}

// TestAttackForgedAddress: D already reads from P. Params naming P's engine id and instance at
// another address use D's existing record of P (nobody is dialled); params naming P's engine id
// with another instance at an attacker's address fail (nothing answers as that engine) without
// dropping D's healthy record. With allowed_peers, such params are refused before any dial.
func TestAttackForgedAddress(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{policy: connector.PolicyRecompute})
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var dialled atomic.Int64
	go func() {
		for {
			c, err := listener.Accept()
			if err != nil {
				return
			}
			dialled.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { listener.Close() })
	host, portText, _ := net.SplitHostPort(listener.Addr().String())
	port, _ := strconv.Atoi(portText)
	s.askOK(t, longPrompt(500), 500)
	mapped := s.d.Connector.Agent().Stats().MappedBytes
	body := completion(longPrompt(501), 12, sampled(501)...)
	want := s.ref.answer(t, "/v1/completions", body)
	moved := prefillDirect(t, s, body)
	moved["remote_host"], moved["remote_port"] = host, port
	if r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(body, "kv_transfer_params", moved)); r.status != 200 || r.text != want {
		t.Fatalf("P's params at another address: %d %s", r.status, r.raw)
	}
	if n := dialled.Load(); n != 0 {
		t.Errorf("D dialled the other address %d times", n)
	}
	impostor := maps.Clone(moved)
	impostor[connector.KeyInstance] = "0123456789abcdef"
	if r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(body, "kv_transfer_params", impostor)); r.status != 200 || r.text != want {
		t.Fatalf("an impostor instance: %d %s", r.status, r.raw)
	}
	s.askOK(t, longPrompt(502), 502)
	if got := s.d.Connector.Agent().Stats().MappedBytes; got != mapped {
		t.Errorf("D maps %d bytes after the forgeries, %d before", got, mapped)
	}
	// With allowed_peers, the impostor's address is refused before any connection.
	d2 := startEngine(t, "D2", engineOptions{role: connector.RoleConsumer, policy: connector.PolicyRecompute, allowedPeers: []string{"localhost"}})
	before := dialled.Load()
	impostor["remote_host"] = "127.0.0.1"
	if r := post(t, s.hc, d2.URL+"/v1/completions", "", withBody(body, "kv_transfer_params", impostor)); r.status != 200 || r.text != want {
		t.Fatalf("an address outside allowed_peers: %d %s", r.status, r.raw)
	}
	if n := dialled.Load() - before; n != 0 {
		t.Errorf("D with allowed_peers dialled a host outside them %d times", n)
	}
	waitMetric(t, s.hc, d2.URL, `kvbridge:kv_auth_refusals_total{kind="params"}`, 1)
}

// TestAttackNotificationFlood: an attacker makes D send P 1,000 release notifications — requests
// to D carrying params that name P, half with a victim's request id and a made-up token, half
// with made-up ids; D reads, finds no lease matching them (500 under policy fail) and notifies P
// with its read. P ends no lease (the victim's read afterwards succeeds), counts them, and logs
// at most one line of each kind per 10 s. (Requests D refuses before its engine, which this test
// used to send, no longer notify P at all: D never saw a prompt to prove.)
func TestAttackNotificationFlood(t *testing.T) {
	t.Parallel()
	leakCheck(t)
	s := startStack(t, stackOptions{policy: connector.PolicyFail, pClock: true})
	victim := completion(longPrompt(600), 12, sampled(600)...)
	vp := prefillDirect(t, s, victim)
	start := time.Now()
	for i := range 1000 {
		kv := maps.Clone(vp)
		var tok [16]byte
		tok[0], tok[1] = byte(i), byte(i>>8)
		kv[connector.KeyLease] = hex.EncodeToString(tok[:])
		if i%2 == 1 {
			kv["remote_request_id"] = fmt.Sprintf("made-up-%d", i)
		}
		if r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(victim, "kv_transfer_params", kv)); r.status != 500 {
			t.Fatalf("flood request %d: %d %s", i, r.status, r.raw)
		}
	}
	waitMetric(t, s.hc, s.p.URL, `kvbridge:kv_auth_refusals_total{kind="notification"}`, 500)
	waitMetric(t, s.hc, s.p.URL, "vllm:nixl_num_notifications_after_expiry_total", 500)
	elapsed := time.Since(start)
	allowed := 2 + int(elapsed/(10*time.Second))
	log := s.p.log.String()
	for _, line := range []string{"refusing a KV notification", "Potentially invalid KV blocks"} {
		if n := strings.Count(log, line); n < 1 || n > allowed {
			t.Errorf("P logged %q %d times for 500 notifications in %v (at most %d)", line, n, elapsed.Round(time.Millisecond), allowed)
		}
	}
	if r := post(t, s.hc, s.d.URL+"/v1/completions", "", withBody(victim, "kv_transfer_params", vp)); r.status != 200 || r.text != s.ref.answer(t, "/v1/completions", victim) {
		t.Fatalf("the victim's read after the flood: %d %s", r.status, r.raw)
	}
	s.p.waitPoolFull(t)
}
