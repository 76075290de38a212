package reliability

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/proxy"
	kvstack "github.com/kvbridge/kvbridge/stack"
)

// legThief is the transport of a proxy's engine legs with an eavesdropper on it: the first leg
// to host that carries pull params (remote blocks named) is copied — what anyone who can read
// the proxy's plaintext legs, or a store that keeps them in clear text, learns — and held until
// the attacker has used the copy.
type legThief struct {
	next   *http.Transport
	host   string
	stolen chan map[string]any // receives the copy, once
	resume chan struct{}       // closed when the held leg may go on
	once   sync.Once
}

func newLegThief(host string) *legThief {
	tr := kvstack.NewTransport(16)
	tr.ResponseHeaderTimeout = time.Minute
	return &legThief{next: tr, host: host, stolen: make(chan map[string]any, 1), resume: make(chan struct{})}
}

func (lt *legThief) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != lt.host || req.Method != http.MethodPost || req.Body == nil {
		return lt.next.RoundTrip(req)
	}
	data, err := io.ReadAll(req.Body)
	req.Body.Close()
	if err != nil {
		return nil, err
	}
	req = req.Clone(req.Context())
	req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(data)), int64(len(data))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	var b struct {
		KV map[string]any `json:"kv_transfer_params"`
	}
	if json.Unmarshal(data, &b) == nil && b.KV != nil && b.KV["remote_block_ids"] != nil {
		held := false
		lt.once.Do(func() { lt.stolen <- b.KV; held = true })
		if held {
			select {
			case <-lt.resume:
			case <-req.Context().Done():
				return nil, req.Context().Err()
			}
		}
	}
	return lt.next.RoundTrip(req)
}

// CloseIdleConnections closes the idle connections of the legs (the proxy's Close).
func (lt *legThief) CloseIdleConnections() { lt.next.CloseIdleConnections() }

// steal waits (at most requestDeadline) for the copied params.
func (lt *legThief) steal(t *testing.T) map[string]any {
	t.Helper()
	select {
	case kv := <-lt.stolen:
		return kv
	case <-time.After(requestDeadline):
		t.Fatal("no leg carried pull params")
		return nil
	}
}

// thievingProxy starts a proxy in front of s's engines whose legs to host pass lt.
func thievingProxy(t *testing.T, s *stack, lt *legThief, multiTurn bool) *runningProxy {
	t.Helper()
	cfg := proxyOptions{multiTurn: multiTurn}.config()
	cfg.Transport = lt
	cfg.Prefill, cfg.Decode = []string{hostPort(s.httpP.URL())}, []string{hostPort(s.httpD.URL())}
	p, err := kvstack.StartProxy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rp := &runningProxy{p}
	t.Cleanup(func() {
		select {
		case <-lt.resume:
		default:
			close(lt.resume) // a failed case must not leave the held leg behind
		}
		rp.close()
	})
	return rp
}

// pulled returns the tokens e's connector has loaded from peers.
func pulled(t *testing.T, e *engine) int64 {
	t.Helper()
	st, err := e.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st.PulledTokens
}

// TestAttackStolenLeaseToken: an attacker who has a victim's kv_transfer_params — lease token
// included, copied off the proxy's legs while the victim's request is on its way — sends them
// straight to an engine with a prompt of its own. The engine reads, finds the blocks are not its
// prompt's (500 under policy fail), and its release notification, which cannot prove the
// victim's prompt, is refused and counted by the owner of the blocks, which keeps the lease. The
// victim's read then succeeds: its tokens are pulled, not recomputed, and its answer is the
// single engine's. One-way: the decode leg's P params, used on D (which used to make P free the
// victim's blocks: the victim got 500). Bidirectional: turn 2's prefill leg carries D's params,
// used on P (which used to make D free the conversation's hold: turn 2 recomputed).
func TestAttackStolenLeaseToken(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		bidi  bool
		owner func(s *stack) *engine // the engine whose lease the attacker tries to end
	}{
		{"one-way", false, func(s *stack) *engine { return s.p }},
		{"bidirectional", true, func(s *stack) *engine { return s.d }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakCheck(t)
			s := startStack(t, stackOptions{policy: connector.PolicyFail, bidirectional: tc.bidi, pClock: true})
			owner, reader := tc.owner(s), s.d
			target := s.httpD.URL()
			if tc.bidi {
				owner, reader, target = s.d, s.p, s.httpP.URL()
			}
			lt := newLegThief(hostPort(target))
			px := thievingProxy(t, s, lt, tc.bidi)

			victim := completion(longPrompt(240), 12, sampled(240)...)
			if tc.bidi {
				victim = withBody(victim, "conversation_id", "victim")
				r := post(t, s.hc, px.URL+"/v1/completions", "", victim) // turn 1: D holds the conversation
				if want := s.ref.answer(t, "/v1/completions", victim); r.status != 200 || r.text != want {
					t.Fatalf("turn 1: %d %q, the single engine says %q", r.status, r.text, want)
				}
				victim = withBody(victim, "prompt", victim["prompt"].(string)+r.text+" And then?", "seed", 241)
			}
			before := pulled(t, reader)
			done := make(chan reply, 1)
			go func() {
				r, err := tryPost(t.Context(), s.hc, px.URL+"/v1/completions", "", victim)
				if err != nil {
					t.Errorf("the victim's request: %v", err)
				}
				done <- r
			}()
			stolen := lt.steal(t)

			// The attacker's request: its own prompt, the victim's params, straight to the
			// engine that reads (the proxies refuse params from clients).
			attack := withBody(completion(longPrompt(242), 12), "kv_transfer_params", stolen)
			// One-way, D reads P's blocks and finds they are not its prompt's: 500 under fail.
			// Bidirectional, P's own prompt does not match D's hash hints: it pulls nothing and
			// computes the prompt itself (200), still telling D it will not read.
			wantStatus := 500
			if tc.bidi {
				wantStatus = 200
			}
			if r := post(t, s.hc, target+"/v1/completions", "", attack); r.status != wantStatus {
				t.Fatalf("the attack: %d %s, want %d", r.status, r.raw, wantStatus)
			}
			// The attacker's notification reaches the owner asynchronously: wait until the
			// owner refused it (or, as before the fix, ended the lease).
			refusals := `kvbridge:kv_auth_refusals_total{kind="notification"}`
			eventually(t, "the owner to act on the attacker's notification", func() bool {
				st, err := owner.Stats()
				return metric(t, s.hc, owner.URL, refusals) >= 1 || (err == nil && st.Held == 0)
			})
			close(lt.resume)
			r := <-done
			if want := s.ref.answer(t, "/v1/completions", victim); r.status != 200 || r.text != want {
				t.Fatalf("the victim's read after the attack: %d %q (%s); the single engine says %q", r.status, r.text, r.raw, want)
			}
			if got := pulled(t, reader) - before; got <= 0 {
				t.Errorf("the victim's read pulled %d tokens: it recomputed", got)
			}
			if tc.bidi {
				n, _ := strconv.Atoi(r.header.Get(proxy.HeaderPulledTokens))
				if r.header.Get(proxy.HeaderCache) != "hit" || n <= 0 {
					t.Errorf("turn 2: %s %s, pulled %q tokens; want a hit", proxy.HeaderCache, r.header.Get(proxy.HeaderCache), r.header.Get(proxy.HeaderPulledTokens))
				}
				// P's own notification, which proves the conversation, ended turn 1's hold: D
				// holds turn 2's blocks only.
				eventually(t, "D to end turn 1's hold", func() bool { st, err := s.d.Stats(); return err == nil && st.Held == 1 })
			}
			if got := metric(t, s.hc, owner.URL, refusals); got != 1 {
				t.Errorf("the owner refused %v notifications, want 1", got)
			}
			if tc.bidi {
				// The attacker's own request asked P to prefill for a decoder (the stolen params
				// say do_remote_decode): P holds those blocks until kv_lease_duration passes.
				s.p.clock.advance(t, 31*time.Second)
			}
			s.p.waitPoolFull(t)
			if !tc.bidi {
				s.d.waitPoolFull(t)
			}
		})
	}
}
