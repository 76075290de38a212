package stack

import (
	"context"
	"fmt"
	"io"

	"github.com/kvbridge/kvbridge/model"
)

// OpenModel opens the model name for a run, saying so on progress (when not nil): the prologue
// of every benchmark and of the demo, which share one opened model among their stacks.
func OpenModel(ctx context.Context, name string, progress io.Writer) (*model.Model, error) {
	Printer(progress)("loading %s", name)
	m, err := model.Open(ctx, name, model.OpenOptions{})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	return m, nil
}

// Printer returns a function that prints one line to w per call (format and args as
// fmt.Printf's), or nothing when w is nil: the progress lines of a run.
func Printer(w io.Writer) func(format string, args ...any) {
	return func(format string, args ...any) {
		if w != nil {
			fmt.Fprintf(w, format+"\n", args...)
		}
	}
}
