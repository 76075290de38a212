package conversation

import (
	"testing"

	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// TestDriveBothModes: the same two-turn workload gives the same answers one-way and
// bidirectional, one row per conversation and turn, and in bidirectional mode P pulls the
// history from D on turn 2 and computes less than the prompt. Every pool is full after the
// stacks close.
func TestDriveBothModes(t *testing.T) {
	m, err := stack.OpenModel(t.Context(), model.Tiny, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	opts := Options{Model: m, Conversations: 2, Turns: 2, UserTokens: 96, AnswerTokens: 8, NumBlocks: 256}
	var started []*stack.Stack
	runs, err := RunSideBySide(t.Context(), opts, func(s *stack.Stack) { started = append(started, s) }, stack.OneWay, stack.Bidirectional)
	if err != nil {
		t.Fatal(err)
	}
	if len(started) != 2 || len(runs) != 2 {
		t.Fatalf("%d stacks, %d runs; want 2 each", len(started), len(runs))
	}
	for _, s := range started {
		if err := s.CheckPools(); err != nil {
			t.Error(err)
		}
	}
	for _, run := range runs {
		mode := run.Mode
		if len(run.Rows) != 4 {
			t.Fatalf("%s: %d rows, want 4", mode, len(run.Rows))
		}
		for i, r := range run.Rows {
			if r.Conversation != i%2+1 || r.Turn != i/2+1 || r.Answer == "" || r.TTFTMs <= 0 || r.PromptTokens <= 0 || r.AnswerTokens != 8 {
				t.Errorf("%s row %d: %+v", mode, i, r)
			}
			if r.DReadBytes <= 0 {
				t.Errorf("%s row %d: D read no KV from P", mode, i)
			}
			switch {
			case mode == stack.OneWay && (r.Cache != "" || r.PPulledTokens != 0 || r.PComputedTokens != r.PromptTokens):
				t.Errorf("one-way row %d: %+v", i, r)
			case mode == stack.Bidirectional && r.Turn == 2 && (r.Cache != "hit" || r.PPulledTokens <= 0 || r.PReadBytes <= 0 ||
				r.PComputedTokens >= r.PromptTokens || r.HeaderPulledTokens != r.PPulledTokens || r.HeaderComputedTokens != r.PComputedTokens):
				t.Errorf("bidirectional row %d: %+v", i, r)
			}
		}
		if got := run.TTFTPerTurn(); len(got) != 2 || got[0] <= 0 || got[1] <= 0 {
			t.Errorf("%s: TTFT per turn %v", mode, got)
		}
	}
	if same, diff := SameAnswers(runs[0], runs[1]); !same {
		t.Errorf("answers differ between modes: %s", diff)
	}
}
