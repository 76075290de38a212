package bidibench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/kvbridge/kvbridge/conversation"
	"github.com/kvbridge/kvbridge/plot"
)

// WriteReport prints the per-turn tables of both comparisons, the lower bound and the targets.
func WriteReport(w io.Writer, rep *Report) error {
	fmt.Fprintf(w, "kvbridge bench bidirectional: %s, %d conversations × %d turns, user messages %d tokens, answers %d tokens (greedy), %d repetitions\n",
		rep.Model, rep.Conversations, rep.Turns, rep.UserTokens, rep.AnswerTokens, rep.Repeats)
	fmt.Fprintln(w, "TTFT = first content chunk of a streaming chat request through the proxy; median over conversations × repetitions;")
	fmt.Fprintln(w, "the one-way and bidirectional stacks are driven side by side, one request at a time; token and MB columns are means")
	for _, c := range []Comparison{rep.PrefixOff, rep.PrefixOn} {
		title := "P's prefix caching off (--no-enable-prefix-caching, vLLM's evaluation)"
		if c.PrefixCaching {
			title = "P's prefix caching on (--enable-prefix-caching)"
		}
		fmt.Fprintf(w, "\n%s:\n", title)
		if err := writeComparison(w, c); err != nil {
			return err
		}
	}
	b := rep.Bound
	fmt.Fprintf(w, "\nlower bound of the bidirectional turn-%d TTFT (P's prefix caching off): KV read %.1f MB by P from D + %.1f MB by D from P\n  at the memcpy ceiling of %.1f GB/s = %.2f ms (the reads took %.2f ms)\n",
		b.Turn, float64(b.PReadBytes)/1e6, float64(b.DReadBytes)/1e6, b.CeilingGBps, b.TransferMs, b.MeasuredTransferMs)
	fmt.Fprintf(w, "  + prefill of the %d new tokens alone on a fresh engine %.1f ms (median) = %.1f ms; measured %.1f ms = %.2f× the bound\n",
		b.NewTokens, b.PrefillNewMs, b.BoundMs, b.MeasuredMs, b.Factor)
	fmt.Fprintf(w, "compute floor (bare forward steps, medians): the %d new tokens over the %d-token history %.1f ms (%.2f× the fresh prefill)\n",
		b.NewTokens, rep.LastTurnPromptTokens-b.NewTokens, b.ContextPrefillMs, safeDiv(b.ContextPrefillMs, b.PrefillNewMs))
	fmt.Fprintf(w, "  + D's one-token step for the first token %.1f ms + transfer %.2f ms = %.1f ms; measured %.1f ms = %.2f× the compute floor\n",
		b.DStepMs, b.TransferMs, b.ComputeFloorMs, b.MeasuredMs, b.OverheadFactor)
	fmt.Fprintf(w, "\nwhere the turn-%d TTFT goes (ms, medians; engine = the engine's own TTFT: accepted → first output):\n", rep.Turns)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "P prefix caching\tmode\tTTFT\tP engine\tP read\tD engine\tD read\tproxy+HTTP\t")
	for _, c := range []Comparison{rep.PrefixOff, rep.PrefixOn} {
		for _, runs := range [][]*conversation.Run{c.OneWay, c.Bidirectional} {
			b := breakdownOf(runs)
			fmt.Fprintf(tw, "%s\t%s\t%.1f\t%.1f\t%.2f\t%.1f\t%.2f\t%.1f\t\n", conversation.OnOff(c.PrefixCaching), runs[0].Mode, b.ttft, b.pEngine, b.pRead, b.dEngine, b.dRead, b.rest)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "\ntargets:")
	for _, t := range rep.Targets {
		mark := "met"
		switch {
		case t.Informational:
			mark = "info"
		case !t.Met:
			mark = "MISSED"
		}
		fmt.Fprintf(w, "  [%s] %s: %s (goal %s)\n", mark, t.Name, t.Result, t.Goal)
	}
	_, err := fmt.Fprintf(w, "outputs identical across modes: %s\n", yesNo(rep.OutputsIdentical))
	return err
}

// writeComparison prints one comparison's per-turn table.
func writeComparison(w io.Writer, c Comparison) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "turn\tprompt_tokens\tone-way P computed\tbidi P pulled\tbidi P computed\tone-way ms\tbidirectional ms\tratio\tbidi KV moved MB\t")
	ow, bd := c.OneWay, c.Bidirectional
	prompt := conversation.MeanPerTurn(bd, func(t conversation.Turn) float64 { return float64(t.PromptTokens) })
	owComputed := conversation.MeanPerTurn(ow, func(t conversation.Turn) float64 { return float64(t.PComputedTokens) })
	pulled := conversation.MeanPerTurn(bd, func(t conversation.Turn) float64 { return float64(t.PPulledTokens) })
	computed := conversation.MeanPerTurn(bd, func(t conversation.Turn) float64 { return float64(t.PComputedTokens) })
	moved := conversation.MeanPerTurn(bd, func(t conversation.Turn) float64 { return float64(t.BytesMoved()) })
	for i := range c.Ratio {
		fmt.Fprintf(tw, "%d\t%.0f\t%.0f\t%.0f\t%.0f\t%.1f\t%.1f\t%.3f\t%.1f\t\n", i+1, prompt[i], owComputed[i], pulled[i], computed[i],
			c.TTFTOneWayMs[i], c.TTFTBidirectionalMs[i], c.Ratio[i], moved[i]/1e6)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "last turn: bidirectional ÷ one-way = %.3f (gain %.1f%%); outputs identical: %s\n", c.LastTurnRatio, 100*c.Gain, yesNo(c.OutputsIdentical))
	return err
}

// WriteJSON writes v to path as indented JSON.
func WriteJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("bidibench: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("bidibench: %w", err)
	}
	return nil
}

// WritePlot draws the TTFT per turn of the report's four runs as an SVG line chart at path.
func WritePlot(path string, rep *Report) error {
	var buf bytes.Buffer
	err := plot.LineChart(&buf, plot.Chart{
		Title:  fmt.Sprintf("TTFT per turn, %s (median of %d conversations × %d repetitions)", rep.Model, rep.Conversations, rep.Repeats),
		XLabel: "turn", YLabel: "TTFT (ms)",
		Series: []plot.Series{
			{Name: "one-way, P prefix caching off", Y: rep.PrefixOff.TTFTOneWayMs},
			{Name: "bidirectional, P prefix caching off", Y: rep.PrefixOff.TTFTBidirectionalMs},
			{Name: "one-way, P prefix caching on", Y: rep.PrefixOn.TTFTOneWayMs},
			{Name: "bidirectional, P prefix caching on", Y: rep.PrefixOn.TTFTBidirectionalMs},
		},
	})
	if err != nil {
		return fmt.Errorf("bidibench: %w", err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("bidibench: %w", err)
	}
	return nil
}

// breakdown is where a last turn's TTFT goes, medians over the runs' last-turn rows.
type breakdown struct {
	ttft, pEngine, pRead, dEngine, dRead, rest float64
}

func breakdownOf(runs []*conversation.Run) breakdown {
	turn := runs[0].Turns
	med := func(f func(conversation.Turn) float64) float64 { return at(conversation.MedianPerTurn(runs, f), turn) }
	return breakdown{
		ttft:    med(ttft),
		pEngine: med(func(t conversation.Turn) float64 { return t.PEngineMs }),
		pRead:   med(func(t conversation.Turn) float64 { return t.PReadMs }),
		dEngine: med(func(t conversation.Turn) float64 { return t.DEngineMs }),
		dRead:   med(func(t conversation.Turn) float64 { return t.DReadMs }),
		rest:    med(func(t conversation.Turn) float64 { return t.TTFTMs - t.PEngineMs - t.DEngineMs }),
	}
}

// safeDiv returns a ÷ b, or 0 when b is 0.
func safeDiv(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
