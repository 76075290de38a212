package instance

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// memoryFigures returns the machine's memory (MemTotal in /proc/meminfo) and this process's
// resident set (VmRSS in /proc/self/status), in bytes.
func memoryFigures() (total, resident int64, err error) {
	if total, err = procKiB("/proc/meminfo", "MemTotal:"); err != nil {
		return 0, 0, err
	}
	if resident, err = procKiB("/proc/self/status", "VmRSS:"); err != nil {
		return 0, 0, err
	}
	return total, resident, nil
}

// procKiB reads the "key: N kB" line of a /proc file, in bytes.
func procKiB(path, key string) (int64, error) {
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
