package pdbench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// processCPU returns this process's CPU time so far, user plus system (0 if unavailable).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// taskCPU returns the on-CPU time of process pid's threads so far, summed from
// /proc/PID/task/*/schedstat (whose first field is nanoseconds on a CPU). A thread that
// exited meanwhile no longer counts.
func taskCPU(pid int) (time.Duration, error) {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("pdbench: %w", err)
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(dir, t.Name(), "schedstat"))
		if err != nil {
			continue // the thread exited
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("pdbench: %s/schedstat: %w", t.Name(), err)
		}
		sum += time.Duration(ns)
	}
	return sum, nil
}
