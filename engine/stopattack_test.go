package engine

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/fixture"
)

// interTokenLatency runs a bystander request and returns its time per token after the first
// (the gap from its first output to its last, over the tokens between; outputs may arrive in
// bursts, so single gaps mean little).
func interTokenLatency(t *testing.T, e *Engine, prompt []int32, tokens int) time.Duration {
	t.Helper()
	r := greedy("", prompt, tokens)
	r.IgnoreEOS = true
	s, err := e.Add(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	var first time.Time
	n := 0
	timeout := time.After(waitTimeout)
	for {
		select {
		case o := <-s.C():
			if first.IsZero() && len(o.Tokens) > 0 {
				first = time.Now()
			} else {
				n += len(o.Tokens)
			}
			if o.Finished {
				if n < tokens/2 {
					t.Fatalf("bystander: %d tokens after the first, want %d", n, tokens-1)
				}
				return time.Since(first) / time.Duration(n)
			}
		case <-timeout:
			t.Fatal("bystander: no final output in time")
		}
	}
}

func median(d []time.Duration) time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// withLoad runs fn while four sequences of one request, with the given stop strings, generate
// long outputs beside it (re-sent whenever they finish).
func withLoad(t *testing.T, e *Engine, stops []string, fn func()) {
	t.Helper()
	tok := e.Model().Tokenizer()
	prompt := tok.Encode("the attacker")
	var shared *Stops
	if stops != nil {
		shared = NewStops(stops, nil)
	}
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	started := make(chan struct{})
	var once sync.Once
	wg.Add(1)
	go func() {
		defer wg.Done()
		for round := 0; ctx.Err() == nil; round++ {
			var streams []*Stream
			for i := range 4 {
				r := &Request{ID: fmt.Sprintf("load-%d-%d", round, i), Prompt: prompt,
					MaxTokens: e.cfg.MaxModelLen - len(prompt), IgnoreEOS: true, Stop: stops, Stops: shared}
				s, err := e.Add(ctx, r)
				if err != nil {
					break // cancelled
				}
				streams = append(streams, s)
			}
			for _, s := range streams {
				for o := range s.C() {
					if len(o.Tokens) > 0 {
						once.Do(func() { close(started) })
					}
					if o.Finished && o.FinishReason == "stop" {
						t.Errorf("a load stop string matched: %q", o.Text)
					}
				}
			}
		}
	}()
	select {
	case <-started:
	case <-time.After(waitTimeout):
		t.Fatal("the load produced no token")
	}
	fn()
}

// TestStopStringAttackSparesBystanders: a request with n=4 sequences carrying the most stop
// strings the HTTP layer admits (one of the longest length) and generating long outputs does
// not slow a bystander sharing the step loop by more than 2×. The baseline is the bystander
// beside the same four sequences without stop strings, measured in the same test (medians of
// several runs, alternating): beside four long sequences a step costs more in any case, and
// that is not what the stop strings may add. Before they were matched by an automaton, every
// token of every attacking sequence rescanned its last 4 KiB of text for every stop string, and
// the bystander's steps waited for it.
func TestStopStringAttackSparesBystanders(t *testing.T) {
	m := openTiny(t)
	const maxLen = 2048
	e, _ := newTestEngine(t, m, 4*maxLen/16+64, Config{BlockSize: 16, MaxModelLen: maxLen,
		MaxNumSeqs: 8, MaxNumBatchedTokens: 512, PrefixCaching: true, Seed: 1})
	bystander := m.Tokenizer().Encode("a bystander asks a short question")
	const tokens, runs, rounds = 200, 4, 4
	var plain, attacked []time.Duration
	measure := func(into *[]time.Duration) func() {
		return func() {
			for range runs {
				*into = append(*into, interTokenLatency(t, e, bystander, tokens))
			}
		}
	}
	for range rounds {
		withLoad(t, e, nil, measure(&plain))
		withLoad(t, e, fixture.AttackStops(), measure(&attacked))
	}
	base, got := median(plain), median(attacked)
	t.Logf("bystander per-token latency beside four long sequences: %v without stop strings, %v with the attack's (%.2f×)",
		base, got, float64(got)/float64(base))
	if got > 2*base {
		t.Errorf("the stop-string attack slowed the bystander from %v to %v a token (more than 2×)", base, got)
	}
}
