package soak

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// vocabulary is the words of the generated user messages.
const vocabulary = `the cache of keys and values moves between engines while a prefiller computes a prompt
and a decoder streams tokens back to the client through the proxy that remembers each conversation so that
the next turn pulls blocks from the decoder instead of computing the whole history again every time light
refraction colours prism thin plates of air water glass rings bubbles reflected transmitted`

// workload runs conversations through the proxy and compares every answer with the single
// engine's.
type workload struct {
	words       []string
	s           *rig
	rep         *Report
	seed        int64
	concurrency int
}

func newWorkload(s *rig, rep *Report, seed int64, concurrency int) *workload {
	return &workload{words: strings.Fields(vocabulary), s: s, rep: rep, seed: seed, concurrency: concurrency}
}

// run keeps concurrency conversations going until ctx ends.
func (w *workload) run(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range w.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w.seed), uint64(i)+2))
			for n := 0; ctx.Err() == nil; n++ {
				if !w.conversation(ctx, rng, fmt.Sprintf("soak-%d-%d-%d", w.seed, i, n)) {
					sleep(ctx, backoff) // as a client would before trying again
				}
				sleep(ctx, think(rng, convThinkMin, convThinkMax))
			}
		}()
	}
	wg.Wait()
}

func (w *workload) sentence(rng *rand.Rand, n int) string {
	out := make([]string, n)
	for i := range out {
		out[i] = w.words[rng.IntN(len(w.words))]
	}
	return strings.Join(out, " ")
}

// The shape of the conversations: 2–6 turns, a first message of 60–119 words (long enough to
// be worth pulling on the next turn), later ones of 8–31 words, answers of 6–19 tokens. The
// warm-up's first message is longer than any whole conversation.
const (
	minTurns, maxTurns = 2, 6
	firstWords         = 60
	laterWords         = 8
	wordsSpread        = 60
	laterSpread        = 24
	warmUpWords        = 500
)

// warmUp runs concurrency two-turn conversations at once whose first message is longer than
// any conversation of the workload.
func (w *workload) warmUp(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range w.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w.seed), uint64(i)+1000))
			w.talk(ctx, rng, fmt.Sprintf("warm-up-%d", i), 2, warmUpWords)
		}()
	}
	wg.Wait()
}

// backoff is a client's pause after a failed turn.
const backoff = 100 * time.Millisecond

// Think times: a user reads an answer before the next turn, and conversations do not follow one
// another back to back. They keep the load open-ended rather than a closed loop at full speed,
// where the blocks D pins for a conversation's last turn would run its pool dry.
const (
	turnThinkMin, turnThinkMax = 10 * time.Millisecond, 100 * time.Millisecond
	convThinkMin, convThinkMax = 50 * time.Millisecond, 300 * time.Millisecond
)

// think draws a pause in [lo, hi).
func think(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Int64N(int64(hi-lo)))
}

// conversation runs one conversation of the workload's shape; it reports whether every turn
// was served.
func (w *workload) conversation(ctx context.Context, rng *rand.Rand, id string) bool {
	return w.talk(ctx, rng, id, minTurns+rng.IntN(maxTurns-minTurns+1), firstWords+rng.IntN(wordsSpread))
}

// talk runs turns turns of one conversation whose first message has first words; it ends early
// at the first turn that fails (the history would no longer be the one the proxy cached) and
// reports whether every turn was served.
func (w *workload) talk(ctx context.Context, rng *rand.Rand, id string, turns, first int) bool {
	var msgs []map[string]any
	for t := range turns {
		n := laterWords + rng.IntN(laterSpread)
		if t == 0 {
			n = first
		}
		msgs = append(msgs, map[string]any{"role": "user", "content": w.sentence(rng, n)})
		body := map[string]any{"model": model.Tiny, "messages": msgs, "max_tokens": 6 + rng.IntN(14),
			"temperature": 1.0, "seed": rng.IntN(1 << 30), "conversation_id": id}
		streaming := rng.IntN(3) == 0
		got, ok := w.turn(ctx, body, streaming)
		if !ok {
			return false
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": got})
		if t+1 < turns {
			sleep(ctx, think(rng, turnThinkMin, turnThinkMax))
		}
	}
	return true
}

// turn sends one request through the proxy and its twin to the reference engine; it records
// the outcome and returns the answer and whether it was served and right.
func (w *workload) turn(ctx context.Context, body map[string]any, streaming bool) (string, bool) {
	pb := maps.Clone(body)
	pb["stream"] = streaming
	r, err := apiclient.Post(ctx, w.s.client, w.s.URL+"/v1/chat/completions", pb, nil)
	if ctx.Err() != nil && err != nil {
		return "", false // the run ended under the request: not the stack's doing
	}
	pulled, _ := strconv.Atoi(r.Header.Get(proxy.HeaderPulledTokens))
	w.rep.countRequest(r.Header.Get(proxy.HeaderCache), pulled)
	if class := errorClass(r, err, streaming); class != "" {
		w.rep.countError(class)
		return "", false
	}
	rb := maps.Clone(body)
	delete(rb, "conversation_id")
	ref, err := apiclient.Post(context.WithoutCancel(ctx), w.s.refClient, w.s.Single.URL()+"/v1/chat/completions", rb, nil)
	if class := errorClass(ref, err, false); class != "" {
		w.rep.countError("reference engine: " + class)
		return "", false
	}
	if r.Text != ref.Text {
		w.rep.countWrong(WrongOutput{ConversationID: fmt.Sprint(body["conversation_id"]), Turn: len(body["messages"].([]map[string]any)) / 2,
			Cache: r.Header.Get(proxy.HeaderCache), Streaming: streaming, Got: r.Text, Want: ref.Text})
		return "", false
	}
	w.rep.countServed()
	return r.Text, true
}

// errorClass names what went wrong with a request sent (streaming or not), or "" for a good
// answer.
func errorClass(r apiclient.Reply, err error, streaming bool) string {
	switch {
	case err != nil:
		return "client: " + transportClass(err)
	case r.Status != 200:
		return fmt.Sprintf("%d %s", r.Status, codeOf(r.Error))
	case r.Error != nil:
		return "200 stream error event: " + strings.SplitN(fmt.Sprint(r.Error["message"]), ":", 2)[0]
	case r.Malformed != "":
		return "200 answer that is not JSON"
	case streaming && !r.Done:
		return "200 stream ended without [DONE]"
	}
	return ""
}

func codeOf(e map[string]any) string {
	if e == nil {
		return "(no error JSON)"
	}
	switch c := e["code"].(type) {
	case string:
		return c
	case float64:
		return fmt.Sprintf("%v %v", c, e["type"])
	}
	return fmt.Sprint(e["type"])
}

func transportClass(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded), strings.Contains(err.Error(), "Client.Timeout"):
		return "timeout"
	case errors.Is(err, io.ErrUnexpectedEOF), strings.Contains(err.Error(), "unexpected EOF"):
		return "unexpected EOF"
	case strings.Contains(err.Error(), "connection reset"):
		return "connection reset"
	}
	return "other"
}
