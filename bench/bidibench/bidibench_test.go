package bidibench

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/model"
)

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
