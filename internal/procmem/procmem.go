// Package procmem reads memory figures of the machine and of this process from Linux's /proc.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package procmem

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Total returns the machine's memory (MemTotal in /proc/meminfo), in bytes.
func Total() (int64, error) { return kib("/proc/meminfo", "MemTotal:") }

// Resident returns this process's resident set (VmRSS in /proc/self/status), in bytes.
func Resident() (int64, error) { return kib("/proc/self/status", "VmRSS:") }

// ResidentOf returns the resident set of process pid (VmRSS in /proc/PID/status), in bytes.
func ResidentOf(pid int) (int64, error) {
	return kib(fmt.Sprintf("/proc/%d/status", pid), "VmRSS:")
}

// kib reads the "key: N kB" line of a /proc file, in bytes.
func kib(path, key string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), key); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: %s %q: %w", path, key, rest, err)
			}
			return n << 10, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s has no %s line", path, key)
}
