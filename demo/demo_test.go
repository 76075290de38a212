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

	"github.com/kvbridge/kvbridge/bench/bidibench"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

// checkPools asserts that every block of the stack's engines is free (the stack is closed).
func checkPools(t *testing.T, s *bidibench.Stack) {
	t.Helper()
	for _, p := range []struct {
		name string
		free int
		all  int
	}{{"P", s.P.Pool.NumFree(), s.P.Pool.NumBlocks()}, {"D", s.D.Pool.NumFree(), s.D.Pool.NumBlocks()}} {
		if p.free != p.all {
			t.Errorf("%s stack, %s: %d of %d blocks free after close", s.Mode, p.name, p.free, p.all)
		}
	}
}

// TestRun: the demo on kvbridge/tiny, two turns: the JSON has the promised fields, the chart is
// well-formed SVG, the answers agree, and every engine is closed with its pool full.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	var stacks []*bidibench.Stack
	var out bytes.Buffer
	sum, err := Run(t.Context(), Options{
		Model: model.Tiny, Conversations: 2, Turns: 2, UserTokens: 96, AnswerTokens: 8,
		PlotPath: filepath.Join(dir, "demo.svg"), JSONPath: filepath.Join(dir, "demo.json"), Out: &out,
		started: func(s *bidibench.Stack) { stacks = append(stacks, s) },
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
		stack   *bidibench.Stack
		checked bool
	)
	err := Serve(ctx, ServeOptions{Model: model.Tiny, Out: &out, ready: func(s *bidibench.Stack) {
		defer cancel()
		stack = s
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
	if !checked || stack == nil {
		t.Fatal("the stack never became ready")
	}
	checkPools(t, stack)
	for _, want := range []string{"curl -i " + stack.URL + "/v1/chat/completions", `"conversation_id": "session-42"`, secondQuestion} {
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
	data, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil || resp.StatusCode != 200 || len(m.Choices) != 1 {
		t.Fatalf("status %d, %v", resp.StatusCode, err)
	}
	pulled, err := strconv.Atoi(resp.Header.Get(proxy.HeaderPulledTokens))
	if err != nil {
		pulled = -1
	}
	return answer{text: m.Choices[0].Message.Content, cache: resp.Header.Get(proxy.HeaderCache), pulled: pulled}
}
