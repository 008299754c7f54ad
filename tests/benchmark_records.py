"""Invented records in the schemas of L-Eval and LongBench, written to a temporary folder for the tests.

Hand-written text, not benchmark data (no benchmark file is kept in the repository): real L-Eval records are
read at run time from `../shared/data/leval/` by the tests that need them (skipped where that folder is absent).
`records_folder()` writes `leval/<task>.jsonl` and `longbench/<task>.jsonl` once per test process and returns
the folder, laid out as a user's local copy of either benchmark is.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

LEVAL: dict[str, list[dict]] = {'coursera': [{'input': 'The Hill Street community orchard began in 2009 on a plot where a dairy once stood. '
                        'Volunteers planted forty apple trees of twelve old varieties, six pear trees and a row of '
                        'plums along the southern fence. The orchard is run by a committee of five, elected each '
                        'spring, and its costs are paid from the sale of juice at the October harvest fair. In 2016 '
                        'a late frost destroyed most of the blossom, and the fair sold pressed juice from a '
                        'neighbouring farm instead. The committee then planted a hedge of hawthorn on the north side '
                        'to shelter the trees. Children from the primary school visit every term to learn grafting, '
                        'and each class adopts one tree, which it prunes in winter and harvests in autumn.',
               'instructions': ['Question 1. Which fruit trees grow in the orchard?\n'
                                'A. Apple\n'
                                'B. Pear\n'
                                'C. Plum\n'
                                'D. Cherry',
                                'Question 2. Who visits every term?\n'
                                'A. The committee\n'
                                'B. Children from the primary school\n'
                                'C. A farmer\n'
                                'D. The mayor'],
               'outputs': ['ABC', 'B'],
               'source': 'fixture',
               'evaluation': 'exam'}],
 'financial_qa': [{'instructions': ['What was the revenue growth in the quarter?', 'Who is the chief executive?'],
                   'outputs': ['Revenue grew 12 percent year over year.', 'Jane Smith'],
                   'input': 'Earnings call. Jane Smith, chief executive, said revenue grew 12 percent year over year '
                            'in the quarter.',
                   'source': 'financial_qa',
                   'evaluation': 'f1'}],
 'multidoc_qa': [{'input': 'The lighthouse on Gull Point was built in 1871 by the harbour board after two grain '
                           'ships ran aground on the reef in a single winter. Its first keeper, Martha Lind, kept a '
                           'log of every vessel that passed, noting the weather, the state of the sea and the colour '
                           'of the sky at dusk. In 1902 the oil lamp was replaced by an electric lamp powered from '
                           "the town, and the keeper's cottage gained a telephone line. During the storm of 1923 the "
                           "telephone failed, and Lind's grandson rowed to the mainland to report a schooner in "
                           'distress; the crew of nine were rescued the next morning. The light was automated in '
                           '1968. Today the cottage is a small museum where visitors can read the logbooks, climb '
                           'the 112 steps of the tower and see the brass lens, which was made in Paris and weighs '
                           'almost two tonnes.',
                  'instructions': ['Who was the first keeper of the lighthouse?',
                                   'When was the light automated?',
                                   'How many steps does the tower have?'],
                  'outputs': ['Martha Lind', 'In 1968', '112 steps'],
                  'source': 'fixture',
                  'evaluation': 'f1'},
                 {'input': 'The Hill Street community orchard began in 2009 on a plot where a dairy once stood. '
                           'Volunteers planted forty apple trees of twelve old varieties, six pear trees and a row '
                           'of plums along the southern fence. The orchard is run by a committee of five, elected '
                           'each spring, and its costs are paid from the sale of juice at the October harvest fair. '
                           'In 2016 a late frost destroyed most of the blossom, and the fair sold pressed juice from '
                           'a neighbouring farm instead. The committee then planted a hedge of hawthorn on the north '
                           'side to shelter the trees. Children from the primary school visit every term to learn '
                           'grafting, and each class adopts one tree, which it prunes in winter and harvests in '
                           'autumn.',
                  'instructions': ['How many apple trees were planted?', "What pays for the orchard's costs?"],
                  'outputs': ['Forty apple trees', 'The sale of juice at the October harvest fair'],
                  'source': 'fixture',
                  'evaluation': 'human'}],
 'news_summ': [{'instructions': ['Write a summary of the news.'],
                'outputs': ['Heavy rain flooded the city centre on Monday.'],
                'input': 'On Monday heavy rain fell for six hours and flooded streets in the city centre.',
                'source': 'news_summ',
                'evaluation': 'LLM'}],
 'quality': [{'input': 'The lighthouse on Gull Point was built in 1871 by the harbour board after two grain ships '
                       'ran aground on the reef in a single winter. Its first keeper, Martha Lind, kept a log of '
                       'every vessel that passed, noting the weather, the state of the sea and the colour of the sky '
                       'at dusk. In 1902 the oil lamp was replaced by an electric lamp powered from the town, and '
                       "the keeper's cottage gained a telephone line. During the storm of 1923 the telephone failed, "
                       "and Lind's grandson rowed to the mainland to report a schooner in distress; the crew of nine "
                       'were rescued the next morning. The light was automated in 1968. Today the cottage is a small '
                       'museum where visitors can read the logbooks, climb the 112 steps of the tower and see the '
                       'brass lens, which was made in Paris and weighs almost two tonnes.',
              'instructions': ['Why was the lighthouse built?\n'
                               '\n'
                               ' (A) To guide fishing boats home\n'
                               ' (B) Because two grain ships ran aground on the reef\n'
                               ' (C) To house a museum\n'
                               ' (D) To test an electric lamp',
                               'What happened during the storm of 1923?\n'
                               '\n'
                               ' (A) The lens broke\n'
                               ' (B) The cottage burned\n'
                               ' (C) The telephone failed and a crew was rescued\n'
                               ' (D) The keeper left the island'],
              'outputs': ['(B) Because two grain ships ran aground on the reef',
                          '(C) The telephone failed and a crew was rescued'],
              'source': 'fixture',
              'evaluation': 'exam'},
             {'input': 'The Hill Street community orchard began in 2009 on a plot where a dairy once stood. '
                       'Volunteers planted forty apple trees of twelve old varieties, six pear trees and a row of '
                       'plums along the southern fence. The orchard is run by a committee of five, elected each '
                       'spring, and its costs are paid from the sale of juice at the October harvest fair. In 2016 a '
                       'late frost destroyed most of the blossom, and the fair sold pressed juice from a '
                       'neighbouring farm instead. The committee then planted a hedge of hawthorn on the north side '
                       'to shelter the trees. Children from the primary school visit every term to learn grafting, '
                       'and each class adopts one tree, which it prunes in winter and harvests in autumn.',
              'instructions': ['What did the committee plant after the frost?\n'
                               '\n'
                               ' (A) A hawthorn hedge\n'
                               ' (B) More plum trees\n'
                               ' (C) A vegetable garden\n'
                               ' (D) Nothing'],
              'outputs': ['(A) A hawthorn hedge'],
              'source': 'fixture',
              'evaluation': 'exam'}]}

LONGBENCH: dict[str, list[dict]] = {'gov_report': [{'length': 16,
                 'dataset': 'gov_report',
                 'language': 'en',
                 'all_classes': None,
                 '_id': 'gov_report-0',
                 'input': '',
                 'context': 'The agency reviewed the budget and found that spending rose by ten percent over two '
                            'years.',
                 'answers': ['Spending rose ten percent in two years, the agency found.']}],
 'hotpotqa': [{'length': 17,
               'dataset': 'hotpotqa',
               'language': 'en',
               'all_classes': None,
               '_id': 'hotpotqa-0',
               'input': 'Which city is the capital of the country where the river Seine flows?',
               'context': 'Passage 1:\n'
                          'The Seine is a river in northern France.\n'
                          'Passage 2:\n'
                          'Paris is the capital of France.',
               'answers': ['Paris']},
              {'length': 26,
               'dataset': 'hotpotqa',
               'language': 'en',
               'all_classes': None,
               '_id': 'hotpotqa-1',
               'input': 'Who wrote the novel that the film Blade Runner is based on?',
               'context': 'Passage 1:\n'
                          'Blade Runner is a 1982 film based on Do Androids Dream of Electric Sheep?\n'
                          'Passage 2:\n'
                          'That novel was written by Philip K. Dick.',
               'answers': ['Philip K. Dick', 'Philip Kindred Dick']}],
 'lcc': [{'length': 9,
          'dataset': 'lcc',
          'language': 'en',
          'all_classes': None,
          '_id': 'lcc-0',
          'input': '',
          'context': 'def add(a, b):\n    total = a + b\n',
          'answers': ['    return total']}],
 'multifieldqa_zh': [{'length': 9,
                      'dataset': 'multifieldqa_zh',
                      'language': 'zh',
                      'all_classes': None,
                      '_id': 'multifieldqa_zh-0',
                      'input': '中国的首都是哪里？',
                      'context': '北京是中国的首都。',
                      'answers': ['北京']}],
 'passage_count': [{'length': 12,
                    'dataset': 'passage_count',
                    'language': 'en',
                    'all_classes': None,
                    '_id': 'passage_count-0',
                    'input': '',
                    'context': 'Paragraph 1: Cats purr.\n\nParagraph 2: Dogs bark.\n\nParagraph 3: Cats purr.',
                    'answers': ['2']}],
 'passage_retrieval_en': [{'length': 14,
                           'dataset': 'passage_retrieval_en',
                           'language': 'en',
                           'all_classes': None,
                           '_id': 'passage_retrieval_en-0',
                           'input': 'A river in northern France.',
                           'context': 'Paragraph 1: Paris is a city.\n'
                                      '\n'
                                      'Paragraph 2: The Seine flows through northern France.',
                           'answers': ['Paragraph 2']}],
 'trec': [{'length': 24,
           'dataset': 'trec',
           'language': 'en',
           'all_classes': ['Individual', 'City', 'Mountain', 'Other location'],
           '_id': 'trec-0',
           'input': 'Question: What is the tallest mountain on Earth ?\nType:',
           'context': 'Question: Who invented the telephone ?\n'
                      'Type: Individual\n'
                      'Question: What city hosts the Louvre ?\n'
                      'Type: City',
           'answers': ['Mountain']}]}


@functools.lru_cache(maxsize=None)
def records_folder() -> Path:
    """A temporary folder with `leval/` and `longbench/` task files (JSON lines), made once and removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="flexicache-test-records-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for bench, tasks in (("leval", LEVAL), ("longbench", LONGBENCH)):
        (root / bench).mkdir()
        for task, records in tasks.items():
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            (root / bench / f"{task}.jsonl").write_text(lines, encoding="utf-8")
    return root
