package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestBenchSoakUsageErrors: bad soak options exit with status 2 and name the option.
func TestBenchSoakUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "soak", "--policy", "retry"}, "policy"},
		{[]string{"bench", "soak", "--faults", "latency,meteor"}, "meteor"},
		{[]string{"bench", "soak", "--backend", "UCX"}, "backend"},
		{[]string{"bench", "soak", "--duration", "soon"}, "duration"},
	} {
		cmd := exec.Command(os.Args[0], tc.args...)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
		out, err := cmd.CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), tc.want) {
			t.Errorf("kvbridge %s: %v, output %q; want exit status 2 naming %q", strings.Join(tc.args, " "), err, out, tc.want)
		}
	}
}
