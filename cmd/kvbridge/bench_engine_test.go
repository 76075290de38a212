package main

import (
	"os"
	"os/exec"
	"path/filepath"
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

// TestBenchCPUProfile: KVBRIDGE_CPUPROFILE writes a profile, or says on stderr why it cannot
// (the command still runs); bench engine's --cpuprofile together with it is a usage error naming
// both, not the runtime's "cpu profiling already in use".
func TestBenchCPUProfile(t *testing.T) {
	dir := t.TempDir()
	kvbridge := func(env string, args ...string) (int, string) {
		cmd := exec.Command(os.Args[0], args...)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1", env)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), string(out)
		} else if err != nil {
			t.Fatal(err)
		}
		return 0, string(out)
	}
	// `kvbridge bench` alone is a usage error (status 2) that loads nothing.
	prof := filepath.Join(dir, "cpu.pprof")
	if code, out := kvbridge(cpuProfileEnv+"="+prof, "bench"); code != 2 || strings.Contains(out, cpuProfileEnv) {
		t.Errorf("bench with a writable %s: status %d, output %q", cpuProfileEnv, code, out)
	}
	if st, err := os.Stat(prof); err != nil || st.Size() == 0 {
		t.Errorf("profile not written: %v", err)
	}
	bad := filepath.Join(dir, "missing", "cpu.pprof")
	if code, out := kvbridge(cpuProfileEnv+"="+bad, "bench"); code != 2 || !strings.Contains(out, cpuProfileEnv) || !strings.Contains(out, "missing") {
		t.Errorf("bench with an unwritable %s: status %d, output %q; want status 2 and the profile's error", cpuProfileEnv, code, out)
	}
	code, out := kvbridge(cpuProfileEnv+"="+prof, "bench", "engine", "--cpuprofile", filepath.Join(dir, "engine.pprof"), "--model", "kvbridge/tiny",
		"--prompt-len", "4", "--decode-tokens", "0", "--batch", "1", "--decode-steps", "1", "--repeat", "1", "--peak-duration", "1ms")
	if code != 2 || !strings.Contains(out, "--cpuprofile") || !strings.Contains(out, cpuProfileEnv) {
		t.Errorf("bench engine --cpuprofile with %s: status %d, output %q; want status 2 naming both", cpuProfileEnv, code, out)
	}
}
