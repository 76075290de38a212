package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestBenchEngineDTypeUsageErrors: every --dtype of bench engine is checked before anything is
// measured (a bad second value does not wait for the first one's run), and a bad one, like dev
// random-checkpoint's, exits with status 2 naming the flag.
func TestBenchEngineDTypeUsageErrors(t *testing.T) {
	// Small settings, so a run that wrongly starts measuring still ends soon.
	quick := []string{"--model", "kvbridge/tiny", "--prompt-len", "4", "--decode-tokens", "0", "--batch", "1",
		"--decode-steps", "1", "--repeat", "1", "--peak-duration", "1ms"}
	for _, args := range [][]string{
		append([]string{"bench", "engine", "--dtype", "bogus"}, quick...),
		append([]string{"bench", "engine", "--dtype", "float32,half"}, quick...),
		{"dev", "random-checkpoint", t.TempDir(), "--dtype", "bogus"},
	} {
		cmd := exec.Command(os.Args[0], args...)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
		out, err := cmd.CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "--dtype") {
			t.Errorf("kvbridge %s: %v, output %q; want exit status 2 naming --dtype", strings.Join(args, " "), err, out)
		}
		if strings.Contains(string(out), "loading") {
			t.Errorf("kvbridge %s started measuring before rejecting --dtype:\n%s", strings.Join(args, " "), out)
		}
	}
}
