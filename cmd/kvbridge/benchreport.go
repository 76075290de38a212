package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

// benchReport is a benchmark's result that prints itself as a table and saves itself as JSON.
type benchReport interface {
	WriteTable(w io.Writer) error
	WriteJSON(path string) error
}

// writeBenchReport prints r's table on the command's output and, when jsonPath is set, also
// writes r there as JSON and says so on stderr.
func writeBenchReport(cmd *cobra.Command, r benchReport, jsonPath string) error {
	if err := r.WriteTable(cmd.OutOrStdout()); err != nil {
		return err
	}
	if jsonPath == "" {
		return nil
	}
	if err := r.WriteJSON(jsonPath); err != nil {
		return err
	}
	fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonPath)
	return nil
}
