package multiturn

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// ErrConfig reports an invalid generator config or input file; the message names the key.
var ErrConfig = errors.New("invalid input file")

// configErr returns an ErrConfig naming key.
func configErr(key, msg string) error {
	return fmt.Errorf("%w: %s: %s", ErrConfig, key, msg)
}

// GenFileType is the "filetype" of a generator config.
const GenFileType = "generate_conversations"

// GenConfig is a parsed generator config (vLLM's generate_multi_turn.json format):
//
//	{
//	  "filetype": "generate_conversations",
//	  "num_conversations": 24,
//	  "text_files": ["opticks.txt"],
//	  "print_stats": false,
//	  "prompt_input": {
//	    "num_turns":                {"distribution": "uniform", "min": 12, "max": 18},
//	    "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
//	    "prefix_num_tokens":        {"distribution": "lognormal", "average": 1000, "max": 5000},
//	    "num_tokens":               {"distribution": "uniform", "min": 120, "max": 160}
//	  },
//	  "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}}
//	}
//
// common_prefix_num_tokens is optional (constant 0); print_stats is optional.
type GenConfig struct {
	NumConversations int
	// TextFiles are the filler text files as written in the config (see ReadInput for how
	// relative names are resolved).
	TextFiles  []string
	PrintStats bool

	NumTurns              Distribution // messages per conversation (user + assistant)
	CommonPrefixNumTokens Distribution // one draw, shared by all conversations' first turn
	PrefixNumTokens       Distribution // per-conversation prefix of the first turn
	InputNumTokens        Distribution // tokens of each user message
	OutputNumTokens       Distribution // tokens of each assistant answer (sets max/min_tokens)
}

// ParseGenConfig parses and validates a generator config. Errors wrap ErrConfig and name the
// offending key.
func ParseGenConfig(data []byte) (*GenConfig, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if top == nil {
		return nil, configErr("(top level)", "must be a JSON object")
	}
	for _, k := range []string{"filetype", "num_conversations", "text_files", "prompt_input", "prompt_output"} {
		if _, ok := top[k]; !ok {
			return nil, configErr(k, "missing required key")
		}
	}
	var ft string
	if err := json.Unmarshal(top["filetype"], &ft); err != nil || ft != GenFileType {
		return nil, configErr("filetype", fmt.Sprintf("must be %q, got %s", GenFileType, top["filetype"]))
	}
	c := &GenConfig{}
	if err := c.parseScalars(top); err != nil {
		return nil, err
	}
	if err := c.parseDistributions(top); err != nil {
		return nil, err
	}
	return c, nil
}

// parseScalars reads num_conversations, text_files and print_stats.
func (c *GenConfig) parseScalars(top map[string]json.RawMessage) error {
	if err := json.Unmarshal(top["num_conversations"], &c.NumConversations); err != nil {
		return configErr("num_conversations", "must be an integer, got "+string(top["num_conversations"]))
	}
	if c.NumConversations <= 0 {
		return configErr("num_conversations", fmt.Sprintf("must be larger than zero, got %d", c.NumConversations))
	}
	if err := json.Unmarshal(top["text_files"], &c.TextFiles); err != nil || bytes.Equal(bytes.TrimSpace(top["text_files"]), []byte("null")) {
		return configErr("text_files", "must be a list of file names, got "+string(top["text_files"]))
	}
	if len(c.TextFiles) == 0 {
		return configErr("text_files", "must list at least one file")
	}
	for i, f := range c.TextFiles {
		if f == "" {
			return configErr(fmt.Sprintf("text_files[%d]", i), "empty file name")
		}
	}
	if v, ok := top["print_stats"]; ok {
		if err := json.Unmarshal(v, &c.PrintStats); err != nil {
			return configErr("print_stats", "must be true or false, got "+string(v))
		}
	}
	return nil
}

// parseDistributions reads the distributions of the prompt_input and prompt_output sections.
func (c *GenConfig) parseDistributions(top map[string]json.RawMessage) error {
	sections := map[string]map[string]json.RawMessage{}
	for _, s := range []string{"prompt_input", "prompt_output"} {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(top[s], &m); err != nil || m == nil {
			return configErr(s, "must be an object")
		}
		sections[s] = m
	}
	for _, d := range []struct {
		into         *Distribution
		section, key string
		optional     bool
	}{
		{&c.NumTurns, "prompt_input", "num_turns", false},
		{&c.InputNumTokens, "prompt_input", "num_tokens", false},
		{&c.CommonPrefixNumTokens, "prompt_input", "common_prefix_num_tokens", true},
		{&c.PrefixNumTokens, "prompt_input", "prefix_num_tokens", false},
		{&c.OutputNumTokens, "prompt_output", "num_tokens", false},
	} {
		raw, ok := sections[d.section][d.key]
		switch {
		case ok:
			dist, err := parseDistribution(d.section+"."+d.key, raw)
			if err != nil {
				return err
			}
			*d.into = dist
		case d.optional:
			*d.into = Constant{Value: 0}
		default:
			return configErr(d.section+"."+d.key, "missing required key")
		}
	}
	return nil
}

// Params returns the "Conversations Generation Parameters" block of the report, in order.
func (c *GenConfig) Params() [][2]string {
	files := ""
	for i, f := range c.TextFiles {
		if i > 0 {
			files += ", "
		}
		files += f
	}
	return [][2]string{
		{"text_files", files},
		{"input_num_turns", c.NumTurns.String()},
		{"input_common_prefix_num_tokens", c.CommonPrefixNumTokens.String()},
		{"input_prefix_num_tokens", c.PrefixNumTokens.String()},
		{"input_num_tokens", c.InputNumTokens.String()},
		{"output_num_tokens", c.OutputNumTokens.String()},
	}
}
