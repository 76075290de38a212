package tokenizer

import (
	"encoding/json"
	"fmt"
	"slices"
)

// template is what a post-processor adds around a single sequence when special tokens are
// requested (Hugging Face's TemplateProcessing "single", Bert/RobertaProcessing's cls and sep):
// the ids before and after it.
type template struct {
	before, after []int32
}

// parsePostProcessor reads tokenizer.json's post_processor: TemplateProcessing, ByteLevel (which
// adds nothing), Bert/RobertaProcessing and Sequence.
func parsePostProcessor(raw json.RawMessage) (template, error) {
	var tp template
	if isNull(raw) {
		return tp, nil
	}
	var p struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		templateProcessing
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return tp, fmt.Errorf("%w: post_processor: %w", ErrMalformed, err)
	}
	switch p.Type {
	case "ByteLevel":
		return tp, nil
	case "Sequence":
		for _, sub := range p.Processors {
			t, err := parsePostProcessor(sub)
			if err != nil {
				return tp, err
			}
			// Each processor wraps what the earlier ones produced, as Hugging Face's Sequence
			// applies them in order: before2 before1 A after1 after2.
			tp.before = slices.Concat(t.before, tp.before)
			tp.after = slices.Concat(tp.after, t.after)
		}
		return tp, nil
	case "TemplateProcessing":
		return p.templateProcessing.template()
	case "BertProcessing", "RobertaProcessing":
		return bertTemplate(raw, p.Type)
	}
	return tp, fmt.Errorf("%w: post_processor %q (supported: TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence)", ErrUnsupported, p.Type)
}

// templateProcessing is the part of a TemplateProcessing post_processor that builds the
// template of one sequence.
type templateProcessing struct {
	Single []struct {
		SpecialToken *struct {
			ID string `json:"id"`
		} `json:"SpecialToken"`
		Sequence *struct {
			ID string `json:"id"`
		} `json:"Sequence"`
	} `json:"single"`
	SpecialTokens map[string]struct {
		IDs []int64 `json:"ids"`
	} `json:"special_tokens"`
}

// template returns the ids of the "single" template's special tokens before and after
// sequence A, which it must hold once.
func (p *templateProcessing) template() (template, error) {
	var tp template
	seen := false
	for _, item := range p.Single {
		switch {
		case item.Sequence != nil:
			if seen || item.Sequence.ID != "A" {
				return tp, fmt.Errorf("%w: post_processor single template must hold sequence A once", ErrUnsupported)
			}
			seen = true
		case item.SpecialToken != nil:
			st, ok := p.SpecialTokens[item.SpecialToken.ID]
			if !ok {
				return tp, fmt.Errorf("%w: post_processor: special token %q not in special_tokens", ErrMalformed, item.SpecialToken.ID)
			}
			for _, id := range st.IDs {
				if id < 0 || id >= maxTokenID {
					return tp, fmt.Errorf("%w: post_processor: token id %d", ErrMalformed, id)
				}
				if seen {
					tp.after = append(tp.after, int32(id))
				} else {
					tp.before = append(tp.before, int32(id))
				}
			}
		}
	}
	return tp, nil
}

// bertTemplate reads a Bert or Roberta post_processor (raw, of type typ): cls before the
// sequence, sep after it.
func bertTemplate(raw json.RawMessage, typ string) (template, error) {
	var q struct {
		Sep [2]json.RawMessage `json:"sep"`
		Cls [2]json.RawMessage `json:"cls"`
	}
	var sep, cls int64
	if err := json.Unmarshal(raw, &q); err != nil || json.Unmarshal(q.Sep[1], &sep) != nil || json.Unmarshal(q.Cls[1], &cls) != nil {
		return template{}, fmt.Errorf("%w: post_processor %s: sep and cls must be [token, id]", ErrMalformed, typ)
	}
	for _, k := range []struct {
		key string
		id  int64
	}{{"cls", cls}, {"sep", sep}} {
		if k.id < 0 || k.id >= maxTokenID {
			return template{}, fmt.Errorf("%w: post_processor %s: %s token id %d", ErrMalformed, typ, k.key, k.id)
		}
	}
	return template{before: []int32{int32(cls)}, after: []int32{int32(sep)}}, nil
}
