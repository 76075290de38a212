package procmem

import (
	"os"
	"os/exec"
	"testing"
)

// TestResidentOf: ResidentOf reads another process's VmRSS (a live child's is positive), and of
// this process the same line Resident reads; a process that does not exist is an error.
func TestResidentOf(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skipf("no /proc: %v", err)
	}
	cmd := exec.Command("sleep", "10")
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start sleep: %v", err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if n, err := ResidentOf(cmd.Process.Pid); err != nil || n <= 0 {
		t.Errorf("ResidentOf(child) = %d, %v; want a positive size", n, err)
	}
	self, err := ResidentOf(os.Getpid())
	if err != nil || self <= 0 || self%1024 != 0 {
		t.Errorf("ResidentOf(self) = %d, %v; want a positive number of KiB in bytes", self, err)
	}
	if r, err := Resident(); err != nil || r <= 0 {
		t.Errorf("Resident() = %d, %v", r, err)
	}
	if n, err := ResidentOf(-1); err == nil {
		t.Errorf("ResidentOf(-1) = %d, want an error", n)
	}
}
