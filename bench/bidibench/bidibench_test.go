package bidibench

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/model"
)

func openTiny(t *testing.T) *model.Model {
	t.Helper()
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// checkPoolsFull asserts that every block of both engines is free after the stack closed.
func checkPoolsFull(t *testing.T, s *Stack) {
	t.Helper()
	if err := s.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	for name, in := range map[string]interface {
		NumFree() int
		NumBlocks() int
	}{"P": s.P.Pool, "D": s.D.Pool} {
		if in.NumFree() != in.NumBlocks() {
			t.Errorf("%s: %d of %d blocks free after close", name, in.NumFree(), in.NumBlocks())
		}
	}
}

// TestDriveBothModes: the same two-turn workload gives the same answers one-way and
// bidirectional, one row per conversation and turn, and in bidirectional mode P pulls the
// history from D on turn 2 and computes less than the prompt.
func TestDriveBothModes(t *testing.T) {
	m := openTiny(t)
	opts := Options{OpenedModel: m, Conversations: 2, Turns: 2, UserTokens: 96, AnswerTokens: 8}
	runs := map[Mode]*Run{}
	for _, mode := range []Mode{ModeOneWay, ModeBidirectional} {
		o := opts
		o.Mode = mode
		s, err := StartStack(t.Context(), StackConfig{Model: m, Mode: mode, NumBlocks: 256, MaxModelLen: 1024})
		if err != nil {
			t.Fatal(err)
		}
		run, err := Drive(t.Context(), s, o)
		checkPoolsFull(t, s)
		if err != nil {
			t.Fatal(err)
		}
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
			case mode == ModeOneWay && (r.Cache != "" || r.PPulledTokens != 0 || r.PComputedTokens != r.PromptTokens):
				t.Errorf("one-way row %d: %+v", i, r)
			case mode == ModeBidirectional && r.Turn == 2 && (r.Cache != "hit" || r.PPulledTokens <= 0 || r.PReadBytes <= 0 ||
				r.PComputedTokens >= r.PromptTokens || r.HeaderPulledTokens != r.PPulledTokens || r.HeaderComputedTokens != r.PComputedTokens):
				t.Errorf("bidirectional row %d: %+v", i, r)
			}
		}
		if got := run.TTFTPerTurn(); len(got) != 2 || got[0] <= 0 || got[1] <= 0 {
			t.Errorf("%s: TTFT per turn %v", mode, got)
		}
		runs[mode] = run
	}
	if same, diff := SameAnswers(runs[ModeOneWay], runs[ModeBidirectional]); !same {
		t.Errorf("answers differ between modes: %s", diff)
	}
}

// TestRunBench: the whole benchmark on kvbridge/tiny, two turns, one repetition: both
// comparisons have a row per turn, every target is evaluated, the answers agree, and the report
// and the chart are written.
func TestRunBench(t *testing.T) {
	rep, err := RunBench(t.Context(), BenchOptions{Model: model.Tiny, Turns: 2, UserTokens: 96, AnswerTokens: 8, Repeats: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []Comparison{rep.PrefixOff, rep.PrefixOn} {
		if len(c.TTFTOneWayMs) != 2 || len(c.TTFTBidirectionalMs) != 2 || len(c.Ratio) != 2 || len(c.OneWay) != 1 || len(c.Bidirectional) != 1 {
			t.Errorf("prefix caching %v: %+v", c.PrefixCaching, c)
		}
	}
	if !rep.OutputsIdentical {
		t.Error("answers differ between modes")
	}
	if len(rep.Targets) != 5 || rep.Bound.NewTokens <= 0 || rep.Bound.PrefillNewMs <= 0 || rep.Bound.CeilingGBps <= 0 {
		t.Errorf("targets %+v, bound %+v", rep.Targets, rep.Bound)
	}
	var out strings.Builder
	if err := WriteReport(&out, rep); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"prefix caching off", "prefix caching on", "lower bound", "outputs identical across modes: yes"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
	dir := t.TempDir()
	if err := WritePlot(filepath.Join(dir, "b.svg"), rep); err != nil {
		t.Error(err)
	}
	if err := WriteJSON(filepath.Join(dir, "b.json"), rep); err != nil {
		t.Error(err)
	}
}
