package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/stack"
)

// checkPools asserts that every block of the stack's engines is free (the stack is closed).
func checkPools(t *testing.T, s *stack.Stack) {
	t.Helper()
	if err := s.CheckPools(); err != nil {
		t.Error(err)
	}
}

// TestRun: the demo on kvbridge/tiny, two turns: the JSON has the promised fields, the chart is
// well-formed SVG, the answers agree, and every engine is closed with its pool full.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	var stacks []*stack.Stack
	var out bytes.Buffer
	sum, err := Run(t.Context(), Options{
		Model: model.Tiny, Conversations: 2, Turns: 2, UserTokens: 96, AnswerTokens: 8,
		PlotPath: filepath.Join(dir, "demo.svg"), JSONPath: filepath.Join(dir, "demo.json"), Out: &out,
		started: func(s *stack.Stack) { stacks = append(stacks, s) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(stacks) != 2 {
		t.Fatalf("%d stacks started, want 2", len(stacks))
	}
	for _, s := range stacks {
		checkPools(t, s)
	}
	if !sum.OutputsIdentical {
		t.Error("outputs differ between one-way and bidirectional")
	}
	if !strings.Contains(out.String(), "outputs identical: yes") {
		t.Errorf("table:\n%s", out.String())
	}

	data, err := os.ReadFile(filepath.Join(dir, "demo.json"))
	if err != nil {
		t.Fatal(err)
	}
	var j map[string]any
	if err := json.Unmarshal(data, &j); err != nil {
		t.Fatal(err)
	}
	if v, ok := j["outputs_identical"].(bool); !ok || !v {
		t.Errorf("outputs_identical = %v", j["outputs_identical"])
	}
	for _, k := range []string{"ttft_ms_oneway", "ttft_ms_bidirectional"} {
		l, ok := j[k].([]any)
		if !ok || len(l) != 2 {
			t.Errorf("%s = %v, want a list of 2", k, j[k])
			continue
		}
		for _, x := range l {
			if f, ok := x.(float64); !ok || f <= 0 {
				t.Errorf("%s holds %v", k, x)
			}
		}
	}
	if r, ok := j["last_turn_ratio"].(float64); !ok || r <= 0 {
		t.Errorf("last_turn_ratio = %v", j["last_turn_ratio"])
	}

	svg, err := os.ReadFile(filepath.Join(dir, "demo.svg"))
	if err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(svg))
	root := ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("the chart is not well-formed XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && root == "" {
			root = se.Name.Local
		}
	}
	if root != "svg" {
		t.Errorf("the chart's root element is %q", root)
	}
}

// TestServe: the served stack answers the printed second turn as a cache hit (its history
// carries the model's real first answer), and stops with its pools full when ctx ends. The ready
// hook runs on the test's goroutine, inside Serve.
func TestServe(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var (
		out     bytes.Buffer
		running *stack.Stack
		checked bool
	)
	err := Serve(ctx, ServeOptions{Model: model.Tiny, Out: &out, ready: func(s *stack.Stack) {
		defer cancel()
		running = s
		first := post(t, s.URL, firstTurn(model.Tiny))
		if first.cache != "miss" {
			t.Errorf("turn 1: cache %q", first.cache)
		}
		second := post(t, s.URL, secondTurn(model.Tiny, first.text))
		// Whether the hit pulls depends on how the model's answer re-tokenizes (P pulls only
		// verified blocks, at least kv_recompute_threshold tokens); kvbridge/small pulls 80.
		if second.cache != "hit" || second.pulled < 0 {
			t.Errorf("turn 2: cache %q, %d tokens pulled; want a hit", second.cache, second.pulled)
		}
		checked = true
	}})
	if err != nil {
		t.Fatal(err)
	}
	if !checked || running == nil {
		t.Fatal("the stack never became ready")
	}
	checkPools(t, running)
	for _, want := range []string{"curl -i " + running.URL + "/v1/chat/completions", `"conversation_id": "session-42"`, secondQuestion} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the help lacks %q:\n%s", want, out.String())
		}
	}
}

type answer struct {
	text, cache string
	pulled      int
}

func post(t *testing.T, base string, body chatBody) answer {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := base + "/v1/chat/completions"
	r, err := apiclient.Post(ctx, http.DefaultClient, url, body, nil)
	if err == nil {
		err = r.Check(url)
	}
	if err != nil || r.Role != "assistant" {
		t.Fatalf("%v: %s", err, r.Raw)
	}
	pulled, err := strconv.Atoi(r.Header.Get(proxy.HeaderPulledTokens))
	if err != nil {
		pulled = -1
	}
	return answer{text: r.Text, cache: r.Header.Get(proxy.HeaderCache), pulled: pulled}
}
